"""MkDocs hook: the plots in benchmarks/results/ are served as results/NAME.png beside the pages,
so the generated benchmark tables can show them without a copy in docs/."""
from __future__ import annotations

import os

from mkdocs.structure.files import File, Files

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")


def on_files(files: Files, config) -> Files:
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith(".png"):
            files.append(File.generated(config, f"results/{name}", abs_src_path=os.path.join(RESULTS, name)))
    return files
