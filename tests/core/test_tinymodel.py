"""The tiny test model generator writes a GGUF that reads back as a llama model."""

from __future__ import annotations

from pathlib import Path

import gguf

from core.server.tinymodel import CHAT_TEMPLATE, make_tiny_model, vocabulary


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def test_tiny_model_reads_back(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "tiny.gguf", n_layer=3, n_ctx=2048)
    reader = gguf.GGUFReader(path)
    tokens, _, _ = vocabulary()

    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == 3
    assert _field(reader, "llama.context_length") == 2048
    assert _field(reader, "llama.embedding_length") == 64
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert _field(reader, "llama.vocab_size") == len(tokens)
    assert _field(reader, "tokenizer.ggml.tokens") == tokens
    assert _field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    blocks = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    assert blocks == {"0", "1", "2"}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert list(embd.shape) == [64, len(tokens)]  # ne order: n_embd, n_vocab


def test_vocabulary_shape() -> None:
    tokens, scores, types = vocabulary()
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert all(t == gguf.TokenType.BYTE for t in types[3:259])
    assert len(set(tokens)) == len(tokens) == len(scores) == len(types)
    # Prefix closure: every ▁word piece can be reached by merging one char at a time.
    pieces = set(tokens)
    for tok in tokens:
        if tok.startswith("▁") and len(tok) > 2:
            assert tok[:-1] in pieces, tok
    assert len(tokens) > 600


def test_idempotent_and_parameter_sensitive(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny_model(path)
    first = path.stat().st_mtime_ns, path.read_bytes()
    make_tiny_model(path)
    assert (path.stat().st_mtime_ns, path.read_bytes()) == first
    make_tiny_model(path, seed=1)
    assert path.read_bytes() != first[1]
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temp files left


def test_tiny_moe_model_has_stacked_experts(tmp_path: Path) -> None:
    from core.server.gguf_facts import read_facts
    from core.server.tinymodel import make_tiny_moe_model

    path = make_tiny_moe_model(tmp_path / "moe.gguf", n_layer=2, n_expert=4, n_ff=64)
    reader = gguf.GGUFReader(path)
    assert _field(reader, "llama.expert_count") == 4
    assert _field(reader, "llama.expert_used_count") == 2
    shapes = {t.name: list(t.shape) for t in reader.tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == [128, 64, 4]  # ne: n_embd, n_ff, n_expert
    assert shapes["blk.1.ffn_down_exps.weight"] == [64, 128, 4]
    assert shapes["blk.0.ffn_gate_inp.weight"] == [128, 4]
    assert "blk.0.ffn_gate.weight" not in shapes
    facts = read_facts(path)
    assert facts.n_expert == 4
    experts = sum(t.n_bytes for t in reader.tensors if "_exps." in t.name)
    assert experts > 0.5 * sum(facts.layer_bytes)  # most of each layer, as in a real MoE
    # A dense file keeps the parameters (and so the identity) it had before.
    dense = make_tiny_model(tmp_path / "dense.gguf")
    assert "n_expert" not in str(_field(gguf.GGUFReader(dense), "warmslot.tinymodel.params"))
