"""python -m megarl.config --docs > docs/configuration.md"""
import sys

from megarl.config.docs import render_docs

if sys.argv[1:] == ["--docs"]:
    print(render_docs())
else:
    print("usage: python -m megarl.config --docs > docs/configuration.md", file=sys.stderr)
    sys.exit(2)
