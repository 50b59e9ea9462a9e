"""The training card of a draft: `TRAINING.md` rendered from `training_card.json` (one job)."""
from __future__ import annotations


def tau_line(ev: dict) -> str:
    """One line of tau per corpus from an `evaluate_tau` result (for logs)."""
    parts = [f"{c} {v['tau']:.2f} ({v['prompts']})" for c, v in ev["per_corpus"].items() if v["tau"] is not None]
    a = ev["all"]
    return (f"all {a['tau']:.3f} over {a['cycles']} cycles; " if a["tau"] is not None else "no cycles; ") + ", ".join(parts)


def _validation_lines(val: dict) -> list[str]:
    """The card's lines on teacher-forced validation (`validation.Validator`), if it ran."""
    final = val.get("final")
    if not final:
        return []
    curve = ", ".join(f"{p['tau']:.2f}@{p['step']}" for p in val.get("curve", []))
    return [f"- teacher-forced on {final['sequences']} sequences held out of this run's training "
            f"(--val-fraction {val.get('fraction')}): loss {final['loss']}, tau estimate {final['tau']}; "
            f"along the run (tau@step): {curve}"]


def _grown_text(grown_from) -> str:
    """', grown from ...' for a draft grown from a smaller --init-from one (`grow.grow_weights`)."""
    if not grown_from:
        return ""
    return (f", grown from {grown_from['layers']} layer(s) and MLP {grown_from['intermediate_size']} "
            "(new weights add nothing at step 0)")


def _vocab_text(vocab: dict, vocab_size: int) -> str:
    """The card's draft-vocabulary line (`defaults.set_draft_vocab`)."""
    share = (f", {100 * vocab['coverage']:.2f}% of the training answers' tokens" if "coverage" in vocab else "")
    return f"- draft vocabulary: the {vocab['size']} most frequent of {vocab_size} tokens{share}"


def render_card(card: dict) -> str:
    """TRAINING.md: the training card as a short human-readable page."""
    t, d, data, tr = card["target"], card["draft"], card["data"], card["training"]
    opened = bool(data.get("synthetic_openings"))  # the synthetic prompts began with openings
    lines = [
        f"# DFlash draft for {t['name']}",
        "",
        "Block-diffusion draft (DFlash, arXiv 2602.06036) trained by `flashfleet draft train` "
        "with the paper's recipe (§4.2; SpecForge OnlineDFlashModel). Load with "
        "`worker.models.dflash_checkpoint.load_dflash_draft(dir, target)`.",
        "",
        "## Draft",
        f"- {d['layers']} layer(s), block size {d['block_size']}, taps {d['target_layer_ids']} of "
        f"{t['layers']} target layers, mask id {d['mask_token_id']}, MLP {d['intermediate_size']}",
        f"- {d['parameters'] / 1e6:.2f} M parameters, "
        + (f"linear layers {d['quantization']['bits']}-bit (groups of {d['quantization']['group_size']}, "
           f"{d['dtype']} scales)" if d.get("quantization") else d["dtype"]) + f", {d['file_mib']} MiB",
        f"- target fingerprint {t['fingerprint']} (hidden size {t['hidden_size']}, vocab {t['vocab_size']})",
        *([_vocab_text(d["draft_vocab"], t["vocab_size"])] if d.get("draft_vocab") else []),
        "",
        "## Data",
        f"- prompt files: {', '.join(data['files'])} (at most {data['max_prompts_per_file']} per file)",
        f"- {data['train_sequences']} training sequences answered by the target "
        f"({'greedy' if not data['gen_temperature'] else 'T=' + str(data['gen_temperature'])}"
        + (f", plus {data['gen_samples'] - 1} more answer(s) per prompt sampled at T={data['gen_sample_temperature']}"
           if data.get("gen_samples", 1) > 1 else "") + ", up to "
        f"{data['max_new_tokens']} tokens): {data['train_tokens']} tokens, {data['response_tokens']} response tokens, "
        f"{data['ended_with_eos']} ended with EOS; per corpus {data['corpora']}",
        *([f"- prompts written by the target itself (Magpie: sampled after its user-turn prefix at "
           f"T={data.get('synthetic_temperature')}, up to {data.get('synthetic_max_tokens')} tokens"
           + (" after the opening" if opened else "") + f", seed {data.get('seed')}): "
           f"{data['synthetic_prompts_written']} new distinct ones of {data['synthetic_prompts']} requested "
           "(repeats, texts under 16 characters"
           + (", openings the target did not continue" if opened else "")
           + " and the generation time limit drop some)"
           + (f", each begun with the first {data['synthetic_openings']} words of a training prompt of "
              f"{', '.join(data.get('synthetic_openings_from') or []) or 'any file'}" if opened else "")
           + "; their answers are the corpus 'synthetic' above"]
          if data.get("synthetic_prompts") else []),
        *([f"- of these, from earlier runs' data (--extra-data {', '.join(x['dir'] for x in data['extra_data'])}): "
           f"{data.get('extra_greedy_reused', 0)} greedy answers reused instead of generated, "
           f"{data.get('extra_added', 0)} more sequences added; dropped "
           f"{sum(x['heldout_dropped'] for x in data['extra_data'])} held out, "
           f"{sum(x['repeats_dropped'] for x in data['extra_data'])} repeated or too short, "
           f"{sum(x.get('superseded', 0) for x in data['extra_data'])} incomplete answers written again"]
          if data.get("extra_data") else []),
        *(["- generation was cut by its time limit (--gen-max-minutes): some prompts were not answered"]
          if data.get("generation_stopped_by_time_limit") else []),
        f"- held out (by prompt, never trained on): {data['heldout_per_corpus']}",
        "",
        "## Training",
        f"- {tr['steps']} steps ({tr['epochs']} epochs), batch {tr['batch_size']}"
        + (f" per process x {tr['processes']} processes (data parallel)" if tr.get("processes", 1) > 1 else "")
        + f" x {tr['anchors']} anchors, "
        f"S={tr['seq_len']}, {tr['elapsed_s']} s, {tr['label_tokens_per_s']} label tokens/s, "
        f"compute {tr['compute_dtype']}",
        f"- AdamW lr {tr['lr']} (warmup {tr['warmup']}, cosine), weight decay {tr['weight_decay']}, "
        f"clip {tr['grad_clip']}, gamma {tr['gamma']}",
        f"- final loss {tr['final_loss']}, teacher-forced tau estimate {tr['final_train_tau']}",
        *_validation_lines(tr.get("validation") or {}),
        *([f"- started from the weights of {tr['init_from']} (--init-from)" + _grown_text(tr.get("grown_from"))]
          if tr.get("init_from") else []),
        "",
        "## Acceptance length tau on held-out prompts (greedy, tokens per cycle, bonus included)",
        "",
    ]
    evals = card["eval"]
    if not evals:
        lines.append("not measured")
    else:
        names = list(evals)
        lines.append("| corpus | prompts | " + " | ".join(f"tau {n}" for n in names) + " |")
        lines.append("|---|---|" + "---|" * len(names))
        first = evals[names[0]]
        for c in list(first["per_corpus"]) + ["all"]:
            rows = [evals[n]["per_corpus"].get(c) if c != "all" else evals[n]["all"] for n in names]
            taus = [f"{r['tau']:.3f}" + (" ({:.2f}-{:.2f})".format(*r["interval"]) if r.get("interval") else "")
                    if r and r["tau"] is not None else "-" for r in rows]
            lines.append(f"| {c} | {rows[0]['prompts'] if rows[0] else 0} | " + " | ".join(taus) + " |")
        lines.append("")
        lines.append(f"max {first['max_new_tokens']} new tokens per prompt, block size {first['block_size']};"
                     " `all` with its 95% bootstrap interval over prompts."
                     + (" `trained` is the saved (quantized) draft, `unquantized` the same weights before"
                        " quantization." if "unquantized" in evals else ""))
    lines.append("")
    return "\n".join(lines)
