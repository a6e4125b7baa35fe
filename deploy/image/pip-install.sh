#!/bin/sh
# `pip install` into the image's /opt/venv, the one way both build stages install.
#
# Labs behind a TLS-inspecting proxy give pip their CA bundle as the build secret `pip_ca`
# (mounted for this RUN only, so it never lands in a layer); a private index comes as the
# PIP_INDEX_URL / PIP_EXTRA_INDEX_URL build arguments. A build argument that was not given is an
# empty variable, which pip would take as an index URL, so empty ones are unset.
set -eu
if [ -s /run/secrets/pip_ca ]; then
    export PIP_CERT=/run/secrets/pip_ca
fi
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
    eval "value=\${$var:-}"
    if [ -z "$value" ]; then unset "$var"; fi
done
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
exec /opt/venv/bin/pip install "$@"
