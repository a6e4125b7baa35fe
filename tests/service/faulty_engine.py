"""An engine with a bug on purpose, for the test that internal errors are problems too."""

from difftape.server.engine import Engine


class FaultyEngine(Engine):
    def execute(self, op, payload=None):
        if isinstance(op, dict) and op.get("op") == "fill":
            raise RuntimeError("an engine bug")
        if isinstance(op, dict) and op.get("op") == "clear_duals":
            import os

            os._exit(3)  # a worker that exits on its own
        return super().execute(op, payload)
