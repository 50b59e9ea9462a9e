"""Growing a saved DFlash draft (`worker/training/grow.py`, `flashfleet draft train --init-from`
with a larger --intermediate-size / --draft-layers): the grown draft computes what the saved one
did, its new weights learn, and shrinking or another shape is a clear error."""
from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

from tests.test_training import VOCAB, _taps, _write_prompts, tiny_llama, tiny_qwen3
from worker.models.dflash_checkpoint import init_dflash_draft, load_dflash_draft
from worker.training.grow import GrowError, grow_weights


def _draft(target, layers, width, seed):
    draft = init_dflash_draft(target, num_layers=layers, block_size=8, seed=seed, intermediate_size=width,
                              dtype=mx.float32)
    # Trained-looking weights: every parameter moved off its init, so a zero branch is not luck.
    draft.update(tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape, key=mx.random.key(seed)), draft.parameters()))
    mx.eval(draft.parameters())
    return draft


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_qwen3])
@pytest.mark.parametrize("layers,width", [(1, 96), (3, 32), (2, 64)])
def test_grown_draft_computes_the_saved_drafts_function(make_target, layers, width):
    target = make_target()
    saved = _draft(target, 1, 32, seed=1)
    fresh = _draft(target, layers, width, seed=2)
    grown = init_dflash_draft(target, num_layers=layers, block_size=8, seed=3, intermediate_size=width,
                              dtype=mx.float32)
    grown.load_weights(list(grow_weights(dict(tree_flatten(saved.parameters())),
                                         dict(tree_flatten(fresh.parameters()))).items()), strict=True)
    tokens = mx.random.randint(3, VOCAB, (1, 20), key=mx.random.key(4))
    taps = _taps(target, saved, tokens)
    block = mx.array([[int(tokens[0, 12])] + [saved.mask_token_id] * 7])
    want = saved(block, taps[:, :12], saved.make_cache())
    got = grown(block, taps[:, :12], grown.make_cache())
    assert got.shape == want.shape == (1, 7, VOCAB)
    assert mx.allclose(got, want, atol=1e-4).item()
    # The new units are not dead: their random gate/up rows came from `fresh`, not zeros.
    gate = grown.layers[0].mlp.gate_proj.weight
    if width > 32:
        assert mx.abs(gate[32:]).sum().item() > 0 and mx.array_equal(
            gate[32:], fresh.layers[0].mlp.gate_proj.weight[32:]).item()


def test_new_weights_get_gradients():
    """A zero `down` column or `o_proj` must still learn: the loss's gradient reaches them."""
    target = tiny_llama()
    saved = _draft(target, 1, 32, seed=1)
    fresh = _draft(target, 2, 64, seed=2)
    grown = init_dflash_draft(target, num_layers=2, block_size=8, seed=3, intermediate_size=64, dtype=mx.float32)
    grown.load_weights(list(grow_weights(dict(tree_flatten(saved.parameters())),
                                         dict(tree_flatten(fresh.parameters()))).items()), strict=True)
    tokens = mx.random.randint(3, VOCAB, (1, 20), key=mx.random.key(4))
    taps = _taps(target, saved, tokens)
    block = mx.array([[int(tokens[0, 12])] + [saved.mask_token_id] * 7])
    labels = tokens[:, 13:20]

    def loss(model):
        return nn.losses.cross_entropy(model(block, taps[:, :12], model.make_cache()), labels).mean()

    grads = dict(tree_flatten(nn.value_and_grad(grown, loss)(grown)[1]))
    assert mx.abs(grads["layers.0.mlp.down_proj.weight"][:, 32:]).sum().item() > 0
    assert mx.abs(grads["layers.1.self_attn.o_proj.weight"]).sum().item() > 0
    assert mx.abs(grads["layers.1.mlp.down_proj.weight"]).sum().item() > 0


def test_grow_refuses_what_is_not_growth():
    target = tiny_llama()
    saved = dict(tree_flatten(_draft(target, 2, 64, seed=1).parameters()))
    with pytest.raises(GrowError, match="fewer layers"):
        grow_weights(saved, dict(tree_flatten(_draft(target, 1, 64, seed=2).parameters())))
    with pytest.raises(GrowError, match="only the MLP width and the number of layers can grow"):
        grow_weights(saved, dict(tree_flatten(_draft(target, 2, 32, seed=2).parameters())))


def test_cli_grows_a_saved_draft_and_refuses_to_shrink_it(tmp_path, tiny_models):
    """`draft train --init-from D --intermediate-size N --draft-layers M`: the card and the log say
    it grew, the saved draft has the new shape and loads; its first loss equals the saved
    draft's continued unchanged (the same function); a resumed grown run keeps `grown_from`; a
    smaller size, a size over --max-draft-mib, another size than the checkpoint being resumed, a
    missing directory or a file is exit 2 (the last two before any data is generated)."""
    from flashfleet.cli.draft_cmd import main

    files = _write_prompts(tmp_path)
    common = ["--target", str(tiny_models.llama), "--prompts", *map(str, files), "--max-new-tokens", "12",
              "--batch-size", "4", "--anchors", "4", "--block-size", "4", "--heldout-per-corpus", "2",
              "--heldout-fraction", "0.2", "--no-eval", "--no-compile", "--quiet", "--lr", "3e-3",
              "--work-dir", str(tmp_path / "work"), "--seed", "5"]
    first = tmp_path / "first"  # 4-bit, as the shipped drafts: growth starts from its dequantized weights
    assert main(["train", *common, "--out", str(first), "--steps", "30", "--draft-layers", "1",
                 "--intermediate-size", "32", "--no-resume", "--quantize-bits", "4",
                 "--quantize-group-size", "32"]) == 0
    same, grown = tmp_path / "same", tmp_path / "grown"
    step0 = ["--steps", "1", "--no-resume", "--log-every", "1", "--init-from", str(first), "--lr", "0"]
    assert main(["train", *common, "--out", str(same), *step0]) == 0
    assert main(["train", *common, "--out", str(grown), *step0, "--intermediate-size", "64",
                 "--draft-layers", "2"]) == 0
    cards = {d: json.loads((d / "training_card.json").read_text()) for d in (same, grown)}
    assert cards[grown]["training"]["grown_from"] == {"layers": 1, "intermediate_size": 32}
    assert cards[same]["training"]["grown_from"] is None
    assert cards[grown]["draft"]["layers"] == 2 and cards[grown]["draft"]["intermediate_size"] == 64
    assert cards[grown]["training"]["curve"][0]["loss"] == pytest.approx(
        cards[same]["training"]["curve"][0]["loss"], rel=1e-4)
    assert "grown from 1 layer(s) and MLP 32" in (grown / "TRAINING.md").read_text()
    from mlx_lm import load

    target, _ = load(str(tiny_models.llama))
    loaded = load_dflash_draft(grown, target)
    assert len(loaded.layers) == 2 and loaded.layers[0].mlp.down_proj.weight.shape[-1] == 64
    assert main(["train", *common, "--out", str(tmp_path / "bad"), "--steps", "1", "--no-resume",
                 "--init-from", str(grown), "--intermediate-size", "32"]) == 2
    # Over --max-draft-mib: the grown size is what was asked, so it is an error, not a shrink.
    assert main(["train", *common, "--out", str(tmp_path / "bad"), *step0, "--intermediate-size", "64",
                 "--max-draft-mib", "0.001"]) == 2
    # A grown run that resumes keeps its growth in the card; another size in its work dir is refused.
    grow = ["--init-from", str(first), "--intermediate-size", "64", "--work-dir", str(tmp_path / "w_grow"),
            "--checkpoint-every", "1", "--out", str(tmp_path / "g2")]
    assert main(["train", *common, *grow, "--steps", "2"]) == 0
    assert main(["train", *common, *grow, "--steps", "3"]) == 0
    card = json.loads((tmp_path / "g2" / "training_card.json").read_text())
    assert card["training"]["resumed_from_step"] == 2
    assert card["training"]["grown_from"] == {"layers": 1, "intermediate_size": 32}
    assert main(["train", *common, *grow, "--steps", "4", "--intermediate-size", "128"]) == 2
    # Bad --init-from inputs fail before the target answers any prompt (a fresh work dir stays empty).
    for bad in (tmp_path / "missing", files[0]):
        work = tmp_path / f"w_{bad.name}"
        assert main(["train", *common, "--out", str(tmp_path / "bad"), "--steps", "1", "--no-resume",
                     "--init-from", str(bad), "--work-dir", str(work)]) == 2
        assert not (work / "data").exists()
