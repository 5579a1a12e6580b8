"""Model facts the fit planner needs, read from a GGUF file's header.

`read_facts(path)` walks the GGUF header itself instead of using
`gguf.GGUFReader`: the reader builds numpy views for every element of every
array, which took 10.7 s on Gemma 3 270M's 262,144-token vocabulary, while
skipping those arrays here takes a fraction of a second. The `gguf` package
still supplies the type tables (value types, quantization block sizes).

The layer layout mirrors llama.cpp's loader (`llama_hparams`):

- **Sliding window**: a per-layer ``{arch}.attention.sliding_window_pattern``
  array wins; a scalar pattern is a period; otherwise the period llama.cpp
  hard-codes for the architecture (`SWA_PATTERNS`; Gemma 3: every 6th layer is
  full attention). With period p, layer i slides when ``i % p < p - 1`` (or
  ``i % p != 0`` for "dense first" architectures). An architecture llama.cpp
  has no pattern for runs every layer with full attention, whatever window its
  header mentions — so it is counted in full.
- **Recurrent layers**: mamba/rwkv architectures are recurrent throughout;
  qwen3next-style hybrids are recurrent except every
  ``full_attention_interval``-th layer (default 4); hybrids with a per-layer
  ``head_count_kv`` array (jamba, granite-hybrid, nemotron-h, lfm2) are
  recurrent where that count is 0.
- **MLA** (``attention.kv_lora_rank``): one compressed K of
  ``kv_lora_rank + rope dims`` per token per layer, and no V.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from core.errors import ModelNotFound
from core.server.model import model_identity

__all__ = ["SWA_PATTERNS", "ModelFacts", "read_facts"]

GGUF_MAGIC = b"GGUF"

# Period and "dense first" of the sliding-window layout llama.cpp hard-codes per
# architecture (its src/models/*.cpp `set_swa_pattern` calls) when the file
# states no pattern of its own.
SWA_PATTERNS: dict[str, tuple[int, bool]] = {
    "afmoe": (4, False),
    "cohere2": (4, False),
    "cohere2moe": (4, True),
    "exaone-moe": (4, False),
    "exaone4": (4, False),
    "gemma-embedding": (6, False),
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma3n": (5, False),
    "gpt-oss": (2, False),
    "llama4": (4, False),  # chunked attention: the chunk plays the window's part
    "olmo2": (4, False),
    "plamo3": (8, False),
    "smallthinker": (4, True),
}
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
INTERVAL_HYBRID_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe"})

# Arrays up to this many elements are decoded (per-layer values); longer ones
# (vocabularies, merges) are skipped and only their length is kept.
_MAX_DECODED_ARRAY = 65536
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ArrayInfo:
    """A long metadata array that was skipped: its element type and length."""

    type: int
    count: int


@dataclass(frozen=True)
class ModelFacts:
    """What the fit planner needs to know about one GGUF model.

    Per-layer tuples have `n_layer` entries. A layer with ``n_head_kv[i] == 0``
    keeps no KV cache (a recurrent layer, or one that reuses another's cache).
    """

    path: str
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int  # 0 for MLA: the cache holds no V
    head_dim_k_swa: int
    head_dim_v_swa: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    n_swa: int  # window in tokens, 0 = none
    swa_layers: tuple[bool, ...]
    recurrent_layers: tuple[bool, ...]
    recurrent_state_bytes_per_layer: int  # f32 conv + ssm (or wkv) state, one sequence
    n_expert: int
    weights_bytes: int
    layer_bytes: tuple[int, ...]  # tensors named blk.N.*
    input_bytes: int  # token embeddings: llama.cpp keeps them on the host
    output_bytes: int  # output head + norm: on the GPU once -ngl > n_layer
    has_chat_template: bool
    file_size: int
    mtime_ns: int
    identity: str
    notes: tuple[str, ...] = field(default=())

    @property
    def is_swa(self) -> bool:
        """Some layers use a sliding window."""
        return self.n_swa > 0 and any(self.swa_layers)

    @property
    def is_recurrent(self) -> bool:
        """Some layers keep a recurrent state (mamba/ssm/rwkv/short-conv)."""
        return any(self.recurrent_layers)

    @property
    def n_full_layers(self) -> int:
        """Layers with a full-context KV cache."""
        return sum(
            1 for i in range(self.n_layer) if self.n_head_kv[i] > 0 and not self.swa_layers[i]
        )

    @property
    def n_swa_layers(self) -> int:
        """Layers with a sliding-window KV cache."""
        return sum(1 for i in range(self.n_layer) if self.n_head_kv[i] > 0 and self.swa_layers[i])

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able form (per-layer tuples become lists)."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


class _Header:
    """The key/value metadata and tensor sizes of one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, int] = {}
        with path.open("rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelNotFound(
                    f"{path} is not a GGUF file", hint="llama-server needs a .gguf model file"
                )
            f.seek(0)
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    self._parse(buf)
            except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
                raise ModelNotFound(
                    f"{path} is not a readable GGUF file ({e})",
                    hint="the file may be truncated or damaged; download it again",
                ) from e

    def _parse(self, buf: mmap.mmap) -> None:
        (version,) = struct.unpack_from("<I", buf, 4)
        # A big-endian file shows its version byte-swapped when read little-endian.
        self.order = "<" if version < 0x10000 else ">"
        (self.version,) = struct.unpack_from(self.order + "I", buf, 4)
        n_tensors, n_kv = struct.unpack_from(self.order + "QQ", buf, 8)
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(buf, pos)
            (vtype,) = struct.unpack_from(self.order + "I", buf, pos)
            self.fields[key], pos = self._value(buf, pos + 4, vtype)
        infos: list[tuple[str, int, int | None]] = []  # name, data offset, size if known
        for _ in range(n_tensors):
            name, pos = self._string(buf, pos)
            (n_dims,) = struct.unpack_from(self.order + "I", buf, pos)
            dims = struct.unpack_from(f"{self.order}{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            ttype, offset = struct.unpack_from(self.order + "IQ", buf, pos)
            pos += 12
            n_elem = 1
            for d in dims:
                n_elem *= d
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
                infos.append((name, offset, n_elem // block * type_size))
            except (ValueError, KeyError):
                infos.append((name, offset, None))  # a type newer than the gguf package
        # Tensors of unknown types: the distance to the next tensor's data (which
        # includes at most an alignment's worth of padding).
        align = int(self.fields.get("general.alignment", 32) or 32)
        data_start = (pos + align - 1) // align * align
        ends = sorted({off for _, off, _ in infos} | {len(buf) - data_start})
        for name, offset, size in infos:
            if size is None:
                nxt = next((e for e in ends if e > offset), offset)
                size = nxt - offset
            self.tensors[name] = size

    def _string(self, buf: mmap.mmap, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self.order + "Q", buf, pos)
        end = pos + 8 + n
        return bytes(buf[pos + 8 : end]).decode("utf-8", errors="replace"), end

    def _value(self, buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(buf, pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from(self.order + "IQ", buf, pos)
            pos += 12
            if etype == _STRING:
                if count > _MAX_DECODED_ARRAY:
                    for _ in range(count):  # walk the lengths only
                        (n,) = struct.unpack_from(self.order + "Q", buf, pos)
                        pos += 8 + n
                    return ArrayInfo(etype, count), pos
                items = []
                for _ in range(count):
                    s, pos = self._string(buf, pos)
                    items.append(s)
                return items, pos
            fmt = _SCALAR[etype]
            size = struct.calcsize(fmt)
            if count > _MAX_DECODED_ARRAY:
                return ArrayInfo(etype, count), pos + size * count
            values = list(struct.unpack_from(f"{self.order}{count}{fmt}", buf, pos))
            return values, pos + size * count
        fmt = _SCALAR[vtype]
        (value,) = struct.unpack_from(self.order + fmt, buf, pos)
        return value, pos + struct.calcsize(fmt)


def _split_parts(path: Path, count: int) -> list[Path]:
    """The files of a split model (``name-00001-of-00003.gguf``), first included."""
    m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
    if not m:
        return [path]
    return [
        path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]


def _per_layer(value: Any, n_layer: int, default: int) -> tuple[int, ...]:
    if isinstance(value, list):
        vals = [int(v) for v in value[:n_layer]]
        return tuple(vals + [vals[-1] if vals else default] * (n_layer - len(vals)))
    if value is None:
        return (default,) * n_layer
    return (int(value),) * n_layer


def _swa_period(n_layer: int, period: int, dense_first: bool) -> tuple[bool, ...]:
    if period == 0:
        return (True,) * n_layer
    if dense_first:
        return tuple(i % period != 0 for i in range(n_layer))
    return tuple(i % period < period - 1 for i in range(n_layer))


def read_facts(path: str | Path) -> ModelFacts:
    """Read `ModelFacts` from a GGUF file (the first part of a split model).

    Raises `ModelNotFound` (with a hint) when the file is missing, not a GGUF,
    damaged, or lacks the keys every language model has.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelNotFound(
            f"model file {path} does not exist",
            hint="set server.model to a .gguf file (`warmslot config set server.model PATH`)",
        )
    try:
        head = _Header(path)
    except OSError as e:
        raise ModelNotFound(f"cannot read {path}: {e}", hint="check the file's permissions") from e
    kv = head.fields
    notes: list[str] = []

    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelNotFound(
            f"{path} has no general.architecture", hint="this GGUF is not a usable language model"
        )

    def get(key: str, default: Any = None) -> Any:
        return kv.get(key.format(arch=arch), default)

    n_layer_all = get("{arch}.block_count")
    n_embd = get("{arch}.embedding_length")
    if not isinstance(n_layer_all, int) or not isinstance(n_embd, int) or n_layer_all <= 0:
        raise ModelNotFound(
            f"{path} ({arch}) lacks {arch}.block_count or {arch}.embedding_length",
            hint="this GGUF is not a language model llama-server can serve",
        )
    # Multi-token-prediction layers come last and keep no cache in normal generation.
    nextn = int(get("{arch}.nextn_predict_layers", 0) or 0)
    n_layer = n_layer_all - nextn if 0 < nextn < n_layer_all else n_layer_all

    n_head_l = _per_layer(get("{arch}.attention.head_count"), n_layer_all, 0)
    n_head = max(n_head_l) if n_head_l else 0
    kv_raw = get("{arch}.attention.head_count_kv")
    n_head_kv = list(_per_layer(kv_raw, n_layer_all, n_head))
    per_layer_kv = isinstance(kv_raw, list)
    ff_raw = get("{arch}.feed_forward_length")
    n_ff = max(_per_layer(ff_raw, n_layer_all, 0))

    head_dim_k = int(get("{arch}.attention.key_length", 0) or (n_embd // n_head if n_head else 0))
    head_dim_v = int(get("{arch}.attention.value_length", 0) or head_dim_k)
    kv_lora = int(get("{arch}.attention.kv_lora_rank", 0) or 0)
    if kv_lora:
        rope_dims = int(get("{arch}.rope.dimension_count", 0) or 0)
        head_dim_k, head_dim_v = kv_lora + rope_dims, 0
        n_head_kv = [1 if h else 0 for h in n_head_kv]
        notes.append("multi-head latent attention: one compressed K per token, no V")
    head_dim_k_swa = int(get("{arch}.attention.key_length_swa", 0) or head_dim_k)
    head_dim_v_swa = int(get("{arch}.attention.value_length_swa", 0) or head_dim_v)

    # Recurrent layers.
    has_ssm = get("{arch}.ssm.state_size") is not None
    interval = get("{arch}.full_attention_interval")
    if arch in RECURRENT_ARCHS:
        recurrent = [True] * n_layer_all
    elif interval or (arch in INTERVAL_HYBRID_ARCHS and has_ssm):
        every = int(interval or 4)
        recurrent = [(i + 1) % every != 0 for i in range(n_layer_all)]
        notes.append(f"hybrid: every {every}th layer is attention, the others recurrent")
    elif per_layer_kv and (has_ssm or get("{arch}.shortconv.l_cache") is not None):
        ffs = _per_layer(ff_raw, n_layer_all, 0) if isinstance(ff_raw, list) else None
        # A layer with neither KV heads nor a feed-forward block is the recurrent
        # one (nemotron-h also has plain MLP layers without KV heads).
        recurrent = [h == 0 and (ffs is None or ffs[i] == 0) for i, h in enumerate(n_head_kv)]
    else:
        recurrent = [False] * n_layer_all
    for i, r in enumerate(recurrent):
        if r:
            n_head_kv[i] = 0
    state_elems = 0
    if has_ssm:
        conv = int(get("{arch}.ssm.conv_kernel", 0) or 0)
        inner = int(get("{arch}.ssm.inner_size", 0) or 0)
        d_state = int(get("{arch}.ssm.state_size", 0) or 0)
        groups = int(get("{arch}.ssm.group_count", 0) or 0)
        state_elems = max(conv - 1, 0) * (inner + 2 * groups * d_state) + d_state * inner
    elif get("{arch}.wkv.head_size") is not None:
        shift = int(get("{arch}.token_shift_count", 2) or 2)
        state_elems = shift * n_embd + n_embd * int(get("{arch}.wkv.head_size"))
    elif get("{arch}.shortconv.l_cache") is not None:
        state_elems = n_embd * max(int(get("{arch}.shortconv.l_cache")) - 1, 0)
    if any(recurrent) and not state_elems:
        notes.append("recurrent layers whose state size the header does not state")

    # Layers that reuse an earlier layer's cache keep none of their own.
    shared = int(get("{arch}.attention.shared_kv_layers", 0) or 0)
    if arch == "gemma3n" and not shared:
        shared = max(n_layer_all - 20, 0)
    for i in range(max(n_layer_all - shared, 0), n_layer_all):
        n_head_kv[i] = 0
    for i in range(n_layer, n_layer_all):
        n_head_kv[i] = 0

    # Sliding window.
    n_swa = int(get("{arch}.attention.sliding_window", 0) or 0)
    pattern = get("{arch}.attention.sliding_window_pattern")
    swa: tuple[bool, ...] = (False,) * n_layer_all
    if n_swa > 0:
        if isinstance(pattern, list):
            flags = [bool(v) for v in pattern[:n_layer_all]]
            swa = tuple(flags + [False] * (n_layer_all - len(flags)))
        elif isinstance(pattern, int):
            dense_first = SWA_PATTERNS.get(arch, (0, False))[1]
            swa = _swa_period(n_layer_all, pattern, dense_first)
        elif arch in SWA_PATTERNS:
            swa = _swa_period(n_layer_all, *SWA_PATTERNS[arch])
        else:
            notes.append(
                f"the header states a {n_swa}-token window that llama.cpp does not use for "
                f"{arch}: every layer is counted with full context"
            )
            n_swa = 0
    if not any(swa):
        n_swa = 0

    # Weights, summed over every part of a split model.
    tensors = dict(head.tensors)
    split_count = int(kv.get("split.count", 1) or 1)
    if split_count > 1:
        for part in _split_parts(path, split_count)[1:]:
            if not part.is_file():
                raise ModelNotFound(
                    f"{path} is part 1 of {split_count}, but {part.name} is missing",
                    hint="put every part of the split model in the same folder",
                )
            tensors.update(_Header(part).tensors)
    layer_bytes = [0] * n_layer_all
    for tname, nbytes in tensors.items():
        m = re.match(r"blk\.(\d+)\.", tname)
        if m and int(m.group(1)) < n_layer_all:
            layer_bytes[int(m.group(1))] += nbytes
    input_bytes = tensors.get("token_embd.weight", 0)
    # A tied output head reuses the embeddings, but the GPU still needs its own copy.
    output_bytes = tensors.get("output.weight", input_bytes) + tensors.get("output_norm.weight", 0)

    vocab = get("{arch}.vocab_size")
    if not vocab:
        tokens = kv.get("tokenizer.ggml.tokens")
        vocab = tokens.count if isinstance(tokens, ArrayInfo) else len(tokens or [])
    n_expert = int(get("{arch}.expert_count", 0) or 0)
    stat = path.stat()

    return ModelFacts(
        path=str(path),
        architecture=arch,
        name=str(kv.get("general.name") or path.stem),
        n_layer=n_layer_all,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=tuple(n_head_kv),
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        head_dim_k_swa=head_dim_k_swa,
        head_dim_v_swa=head_dim_v_swa,
        n_ff=n_ff,
        n_vocab=int(vocab),
        n_ctx_train=int(get("{arch}.context_length", 0) or 0),
        n_swa=n_swa,
        swa_layers=swa,
        recurrent_layers=tuple(recurrent),
        recurrent_state_bytes_per_layer=4 * state_elems,
        n_expert=n_expert,
        weights_bytes=sum(tensors.values()),
        layer_bytes=tuple(layer_bytes),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        has_chat_template=bool(kv.get("tokenizer.chat_template")),
        file_size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        identity=model_identity(path),
        notes=tuple(notes),
    )
