"""``python -m specdec.cli``: the same as the ``specdec`` console script."""

from .app import app

app(prog_name="specdec")
