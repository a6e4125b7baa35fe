# CPU image: the difftape library, its demo and its tests. The service image (non-root user,
# healthcheck, CUDA variant) replaces this when difftape.server lands.
FROM python:3.11-slim
RUN useradd --create-home difftape
WORKDIR /home/difftape/app
COPY --chown=difftape:difftape . .
RUN pip install --no-cache-dir -e '.[test]'
USER difftape
CMD ["difftape", "demo"]
