"""The mkdocs hook (mkdocs.yml: hooks): what the site holds besides docs/.

- the reference pages, written from the code at every build (gen_reference.py);
- benchmarks/README.md, benchmarks/RESULTS.md and their figures and screenshots, at the paths they have in the
  repository, so the measured results stay in one file that GitHub and the site both show, with working links.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

import gen_reference  # docs/hooks/gen_reference.py: mkdocs puts a hook's folder on sys.path while it loads the hook

ROOT = Path(__file__).resolve().parents[2]
FROM_REPOSITORY = ("benchmarks/README.md", "benchmarks/RESULTS.md", "benchmarks/figures/*.png",
                   "benchmarks/screenshots/*.png")


def on_files(files: Files, config, **kwargs) -> Files:
    for uri, write in gen_reference.PAGES.items():
        files.append(File.generated(config, uri, content=write()))
    for pattern in FROM_REPOSITORY:
        for path in sorted(ROOT.glob(pattern)):
            files.append(File(path.relative_to(ROOT).as_posix(), str(ROOT), config.site_dir,
                              config.use_directory_urls))
    return files
