"""Every number README.md and docs/results.md state, read from the result file (or the code) that backs it.

Each claim is a fragment of a page's text built from a result file under ``benchmarks/results/`` or from the
package's own defaults; the first test finds each fragment on its page, so a changed result or a changed sentence
fails. The second test reads each page's prose (code blocks and inline code left out) and fails on any digit that
no claim covers and that is not part of a name (``1-bit``, ``0/1 Adam``, ``fp32``...): a number cannot be added to
these pages without a source.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import statistics

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Names with digits in them, not claims.
NAMES = [r"1-bit", r"0/1 Adam", r"fp32", r"fp16", r"bf16", r"v1\.1", r"MiniLM-L6", r"BERT-base", r"BERT-mini",
         r"BERT-Large", r"mpi4jax", r"cuda12", r"[VHA]100", r"H200", r"ZeRO stages? [0-3](?:-[0-3])?(?: and [0-3])?",
         r"stages? [0-3](?:-[0-3])?(?: and [0-3])?", r"ZeRO\+\+", r"Python 3\.11\+?", r"int8", r"L\d+"]


@functools.cache
def _load(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _rows(path: str, **match) -> list[dict]:
    return [r for r in _load(path)["rows"] if all(r.get(k) == v for k, v in match.items())]


def _range(values, fmt: str = "{:.1f}", suffix: str = "x") -> str:
    """``lo-hi`` of the values as the page writes them (one value when they round alike)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return f"{lo}{suffix}" if lo == hi else f"{lo}-{hi}{suffix}"


def _speedup(files, hosts, rate, variant, stage) -> list[float]:
    return [r["speedup_vs_adam"] for f in files for r in _rows(f, hosts=hosts, rate=rate, variant=variant,
                                                                 stage=stage)]


def readme_claims() -> list[str]:
    from jonebit.apps import pretrain

    comm = _rows("comm_bytes/comm_bytes.json")
    ratio = round(min(r["vs_fp32"] for r in comm))
    requires = re.search(r'requires-python\s*=\s*">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    parser = _pretrain_parser()
    # `make run` is the pre-training protocol's first seed without the third arm: its two runs' time on that machine.
    proto = _load("pretrain_protocol/pretrain_protocol.json")
    first = [proto["arms"][arm][0]["seconds"] for arm in ("adam", proto["chosen"])]
    several = "several minutes" if 60 <= sum(first) <= 15 * 60 else f"{sum(first) / 60:.0f} minutes"
    return [f"It takes {several} on {proto['machine']['cpus']} CPU cores",
            f"sends {ratio}x fewer bytes than an fp32 allreduce",
            f"Python {requires}+",
            f"with a {parser.get_default('vocab_size'):,}-token WordPiece vocabulary",
            f"over {pretrain.DEFAULT_DEVICES} simulated CPU devices"]


def _pretrain_parser():
    import argparse

    from jonebit.apps.pretrain import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return sub.choices["pretrain"]


def results_claims() -> list[str]:
    claims = []
    # Bytes.
    base = _rows("comm_bytes/comm_bytes.json", tree="BERT-base 110M")[0]
    claims.append(f"P = {_load('comm_bytes/comm_bytes.json')['world_size']}, from compiled HLO")
    claims.append(f"**{base['vs_fp32']:.1f}x fewer bytes than an fp32 allreduce** ({base['vs_bf16']:.1f}x fewer than "
                  f"bf16) for a BERT-base-shaped {base['params'] / 1e6:.1f}M-parameter tree")
    fam = _load("family_bytes/family_bytes.json")
    runs = {r["optimizer"]: r["vs_adam"] for r in fam["runs"]}
    freeze = 100 * fam["freeze_step"] / fam["steps"]
    var = 100 * fam["var_freeze_step"] / fam["steps"]
    claims.append(f"Over a {fam['steps']:,}-step run (P = {fam['world_size']}), 1-bit Adam or 1-bit LAMB with a "
                  f"{freeze:.0f}% warmup send {runs['1-bit Adam / 1-bit LAMB (freeze at 20%)']:.1f}x fewer bytes "
                  f"than fp32 Adam, and 0/1 Adam (variance frozen after {var:.0f}% of the updates) "
                  f"{runs['0/1 Adam, DeepSpeed defaults']:.1f}x fewer with DeepSpeed's interval defaults, "
                  f"{runs['0/1 Adam, local_step_scaler=1000']:.1f}x with `local_step_scaler=1000`")
    # The emulated cluster.
    flat = ("cluster/cluster.json", "cluster/repeat.json")
    two, four = (_range(_speedup(flat, h, "200mbit", "onebit", "compression")) for h in (2, 4))
    claims.append(f"1-bit Adam's compression stage is **{two} faster than Adam at 200 Mbit/s on 2 hosts and {four} on "
                  "4 hosts**")
    gig = _speedup(flat, 2, "1gbit", "onebit", "compression") + _speedup(flat, 4, "1gbit", "onebit", "compression")
    claims.append(f"but only {_range(gig)} at 1 Gbit/s")
    claims.append(f"on the loaded {_load(flat[0])['machine']['cpus']}-core machine")
    wire = [r["wire_bytes_per_step"] / r["bytes_per_step"] for f in flat for r in _rows(f)
            if r["bytes_per_step"] > 1e6 and r["rate"] != "10gbit"]
    claims.append(f"(x {statistics.fmean(wire):.2f} for TCP/IP framing)")
    mpi = ("cluster/mpi.json", "cluster/mpi_repeat.json")
    fam_c = ("cluster/family.json", "cluster/family_repeat.json")
    claims.append(f"1-bit Adam's compression stage {_range(_speedup(mpi, 2, '200mbit', 'onebit_mpi', 'compression'))} "
                  f"faster than Adam at 200 Mbit/s on 2 hosts; 1-bit LAMB's "
                  f"{_range(_speedup(fam_c, 2, '200mbit', 'onebit_lamb', 'compression'))} and 0/1 Adam's local steps "
                  f"{_range(_speedup(fam_c, 2, '200mbit', 'zero_one_adam', 'local'))} (gloo)")
    ttl = _load("time_to_loss/200mbit.json")
    adam, onebit = ttl["arms"]["adam"], ttl["arms"]["onebit_adam"]
    claims.append(f"BERT-{ttl['model']}, {ttl['steps']} steps on\n  {ttl['hosts']} hosts at 200 Mbit/s, one seed")
    claims.append(f"1-bit Adam finished {ttl['wall_ratio']:.2f}x sooner with "
                  f"{100 * onebit['bytes_sent_per_rank'] / adam['bytes_sent_per_rank']:.0f}% of Adam's bytes")
    claims.append(f"loss ended {100 * ttl['final_loss_gap']:.1f}% above Adam's")
    claims.append(f"no sooner than Adam did ({ttl['speedup_to_common']:.2f}x)")
    fast = _load("time_to_loss/1gbit.json")
    assert fast["arms"]["adam"]["heldout_mlm_loss"] == adam["heldout_mlm_loss"]  # "the same computation, bit for bit"
    assert fast["arms"]["onebit_adam"]["heldout_mlm_loss"] == onebit["heldout_mlm_loss"]
    claims.append("At 1 Gbit/s (the same\n  computation, bit for bit)")
    claims.append(f"it finished only {fast['wall_ratio']:.2f}x sooner")
    claims.append(f"later than Adam ({fast['speedup_to_common']:.2f}x)")
    # Memory.
    zm = {r["variant"]: r for r in _rows("zero_memory/zero_memory.json", precision="fp32", offload=False)}
    s0 = zm["0"]["device_mb"]
    off = max(abs(zm[v]["ratio"] - 1) for v in "0123")
    r1, r2, r3 = (zm[v]["device_mb"] / s0 for v in "123")
    claims.append(f"ZeRO stages 1-3 hold BERT-base's params, grads and AdamW state in {r1:.2f}x, {r2:.2f}x and "
                  f"{r3:.2f}x of stage 0's bytes per device (within {100 * off:.1f}% of the ZeRO formulas)")
    peak = {(r["model"], r["variant"]): r for r in _rows("zero_peak/zero_peak.json", optimizer="adamw")}
    p3, p2 = peak["large", "3"], peak["large", "2"]
    claims.append(f"stage 3's peak is {p3['peak'] / p2['peak']:.2f}x stage 2's for a {p3['layers']}-layer x "
                  f"{p3['hidden']} BERT ({p3['peak']:,.0f} against {p2['peak']:,.0f} MB per device on "
                  f"{_load('zero_peak/zero_peak.json')['devices']} devices, within "
                  f"{100 * abs(p3['ratio'] - 1):.0f}% of model states + one layer + activations)")
    op = {r["variant"]: r for r in _rows("zero_peak/zero_peak.json", optimizer="onebit_adam", model="large")}
    claims.append(f"1-bit Adam's stage 3, which gathers the\n  stacked layers one at a time too, "
                  f"{op['3']['peak'] / op['2']['peak']:.2f}x its stage 2's ({op['3']['peak']:,.0f} against "
                  f"{op['2']['peak']:,.0f} MB)")
    ob = {r["stage"]: r for r in _rows("onebit_zero/onebit_zero.json", optimizer="1-bit Adam")}
    claims.append(f"1-bit Adam under ZeRO stage 3 needs {ob[3]['total_mb'] / ob[0]['total_mb']:.2f}x of its stage-0 "
                  "memory")
    # Compute.
    claims.append(f"**Compute** on {_load('step_cost/step_cost.json')['devices']} simulated CPU devices")
    sc = {r["step"]: r["ratio"] for r in _rows("step_cost/step_cost.json")}
    claims.append(f"costs {sc['1-bit Adam (compression stage)']:.2f}x an AdamW step with an fp32 allreduce (per leaf: "
                  f"{sc['1-bit Adam per-leaf (compression stage)']:.2f}x); the same step compiled as one program with "
                  f"every phase costs {sc['1-bit Adam, one program (compression stage)']:.2f}x "
                  f"({sc['1-bit Adam per-leaf, one program (compression stage)']:.2f}x)")
    claims.append(f"(`benchmarks/step_cost.py`, {_load('step_cost/step_cost.json')['params'] / 1e6:.0f}M parameters)")
    claims.extend(_phase_programs_claims())
    one = _load("bert_step/1thread.json")
    ratios = [r["results"]["jonebit"]["tokens_per_s"] / r["results"]["pytorch"]["tokens_per_s"] for r in one["runs"]]
    b = one["runs"][0]
    claims.append(f"A BERT-base pre-training step (batch {b['batch']} x {b['seq']}, each framework pinned to one "
                  f"core of a loaded machine) ran {ratios[0]:.2f}x and {ratios[1]:.2f}x faster with jonebit than with "
                  "transformers' PyTorch BERT in two runs (medians)")
    sq = _load("squad_inference/squad_inference.json")
    batches = [r["batch"] for r in sq["rows"]]
    claims.append(f"jonebit runs at {_range([r['ratio'] for r in sq['rows']], '{:.2f}')} the throughput of "
                  f"transformers' PyTorch model at batch {min(batches)}-{max(batches)} ({sq['fastest_ratio']:.2f}x at "
                  "each one's fastest batch)")
    claims.append(f"(MiniLM-L6, {sq['seq']}-token dev windows, one pinned core, same weights)")
    eng = {r["optimizer"]: r["ratio"] for r in _rows("engine_overhead/engine_overhead.json")}
    claims.append(f"costs {eng['Adam (fp32 allreduce)']:.2f}x (Adam) and {eng['1-bit Adam (compression stage)']:.2f}x "
                  "(1-bit Adam) of the bare step on the tiny LM (8 simulated devices)")
    claims.extend(_convergence_claims())
    claims.extend(_squad_claims())
    claims.extend(_gpu_claims())
    return claims


def _squad_claims() -> list[str]:
    d = _load("squad_protocol/squad_protocol.json")
    assert d["complete"]
    runs = {(r["seed"], r["arm"]): r for r in d["runs"]}
    gap = {arm: [runs[s, arm]["f1"] - runs[s, "adam"]["f1"] for s in d["seeds"]]
           for arm in ("onebit_adam", "onebit_deepspeed")}
    ours, ds = gap["onebit_adam"], gap["onebit_deepspeed"]
    assert min(ours) > 0  # "above it in every seed"
    sent = d["arms"]["onebit_adam"]["mb_sent_per_rank"][0] / d["arms"]["adam"]["mb_sent_per_rank"][0]
    return [f"(MiniLM-L6, {d['setup']['steps']} steps;", f"all {d['dev_questions']:,} dev\n  questions, "
            f"{len(d['seeds'])} seeds)",
            f"ends {statistics.fmean(ours):+.2f} F1 ({min(ours):+.2f} to {max(ours):+.2f})",
            f"at {100 * sent:.1f}% of Adam's bytes",
            f"arithmetic ends {statistics.fmean(ds):+.2f} F1 ({min(ds):+.2f} to {max(ds):+.2f})"]


def _gpu_claims() -> list[str]:
    runs = [_load(f"gpu_suite/{name}.json") for name in ("h200_pallas", "h200_engine")]
    bert = [r["bert_step"]["arms"] for r in runs]
    step = [a["onebit_make_step"]["step_ms"] / a["adamw_make_step"]["step_ms"] for a in bert]
    opt = [r["optimizer_step"]["ratio_onebit_over_adamw"] for r in runs]
    kernel = [next(x for x in r["kernels"]["rows"] if x["arm"] == "pass_xla") for r in runs]
    copy = [r["packing"]["copy_bytes_per_s"] for r in runs]
    share = [k["gb_per_s"] * 1e9 / c for k, c in zip(kernel, copy, strict=True)]
    assert {r["environment"]["device_kind"] for r in runs} == {"NVIDIA H200"}
    assert all(k["kernels"] == 1 for k in kernel)
    return [f"1-bit Adam's BERT-base bf16 training step costs {_range(step, '{:.2f}')} AdamW's through",
            f"its compression step {_range(opt, '{:.2f}')}",
            f"into one kernel at {_range(share, '{:.2f}', '')} of a copy's bandwidth"]


def _phase_programs_claims() -> list[str]:
    d = _load("phase_programs/phase_programs.json")
    opt = {r["step"]: r["ratio"] for r in d["optimizer_step"]}
    train = {r["step"]: r["ratio"] for r in d["train_step"]}
    return [f"On BERT-mini's tree ({d['params'] / 1e6:.1f}M parameters, {d['leaves']} leaves) the default 1-bit Adam's "
            f"compression step costs {opt['1-bit Adam, per phase']:.2f}x AdamW's and the engine's whole training step "
            f"(batch {d['batch']} x {d['seq']}) {train['1-bit Adam, per phase']:.2f}x"]


def _convergence_claims() -> list[str]:
    d = _load("pretrain_protocol/pretrain_protocol.json")
    s = d["summary"]
    chosen = d["chosen"]
    per = ", ".join(f"{g:+.2f}%" for g in s[chosen]["heldout_gap_percent"])
    other = [n for n in d["candidates"] if n != chosen][0]
    return [f"{len(d['seeds'])} seeds", f"{d['steps']} steps",
            f"{int(d['masked_tokens']['heldout']):,} masked tokens", f"{int(d['masked_tokens']['validation']):,}",
            f"{s[chosen]['heldout_gap_percent_spread']['mean']:+.2f}% ({per})",
            f"{s[other]['heldout_gap_percent_spread']['mean']:+.2f}%",
            f"{100 * s[chosen]['bytes_vs_adam']:.1f}% of Adam's bytes",
            f"{100 * s[other]['bytes_vs_adam']:.1f}%"]


PAGES = {"README.md": readme_claims, "docs/results.md": results_claims}


def _prose(text: str) -> str:
    text = re.sub(r"```.*?```", " ", text, flags=re.S)  # code blocks: executed by tests/test_readme.py
    text = re.sub(r"`[^`\n]*`", " ", text)  # inline code: names, flags, paths
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    return " ".join(text.split())


@pytest.mark.parametrize("page", PAGES)
def test_every_claim_is_on_its_page(page):
    text = " ".join((ROOT / page).read_text().split())
    missing = [c for c in PAGES[page]() if " ".join(c.split()) not in text]
    assert not missing, f"{page} does not say (the result files do): {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_every_number_on_the_page_is_a_claim_or_a_name(page):
    prose = _prose((ROOT / page).read_text())
    covered = bytearray(len(prose))
    for fragment in [_prose(c) for c in PAGES[page]()] + [None]:
        spans = re.finditer("|".join(NAMES), prose) if fragment is None else \
            re.finditer(re.escape(fragment), prose)
        for m in spans:
            covered[m.start():m.end()] = b"\1" * (m.end() - m.start())
    loose = [prose[max(0, m.start() - 30):m.end() + 30] for m in re.finditer(r"\d", prose) if not covered[m.start()]]
    assert not loose, f"{page}: numbers no claim of tests/test_claims.py backs: {loose}"
