"""Time to a held-out loss on the emulated cluster: ``jonebit pretrain`` with Adam and with 1-bit Adam, same steps.

For each link rate: a cluster of ``--hosts`` network namespaces joined by links shaped to that rate
(:class:`netns.Cluster`), and in it, one after the other, the Adam and the 1-bit Adam job: ``jonebit pretrain``
run as ``--hosts`` processes (one per namespace, one CPU device each, ``jax.distributed`` over gloo through the
shaped links) on the same instances, seed, schedule and number of steps. Per arm it records the training
wall-clock at every evaluation (the run's metrics: the sum of the step times, compilation included, evaluation
excluded), the held-out MLM loss there, the bytes each rank sent (the compiled programs' accounting) and the
bytes through each host's qdisc. The time to loss is the wall-clock at which 1-bit Adam's held-out loss first
reaches Adam's final held-out loss (linear between evaluations); if it never does, the result says so.

    sudo .venv/bin/python benchmarks/cluster/time_to_loss.py --hosts 4 --rates 200mbit --steps 600
    sudo .venv/bin/python benchmarks/cluster/time_to_loss.py --cleanup     # leftovers of a killed run

Writes ``benchmarks/results/time_to_loss/<rate>.json`` and ``.png`` (``--tag`` prefixes the names). Each arm's
run directory is kept under ``--workdir``; a finished arm (its ``done.json``) is not run again, so an interrupted
study continues where it stopped. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cluster.netns import Cluster, Layout, exec_prefix, missing_requirements  # noqa: E402

COORDINATOR_PORT = 12399
CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "squad-train-articles.txt"
VOCAB = ROOT.parent / "shared" / "data" / "vocab" / "bert-base-uncased-vocab.txt"


def arm_configs(steps: int, batch: int, lr: float, freeze: float) -> dict[str, dict]:
    """Adam and 1-bit Adam: ``jonebit pretrain``'s embedded configs (same schedule), 1-bit Adam frozen at ``freeze``."""
    from jonebit.apps.pretrain import default_configs

    cfgs = default_configs(steps, batch, lr=lr)
    cfgs["onebit_adam"]["optimizer"]["params"]["freeze_step"] = max(2, round(freeze * steps)) + 1
    for cfg in cfgs.values():
        cfg["steps_per_print"] = 1  # a metrics line per step: the wall-clock at every step
    return cfgs


def prepare(args, work: pathlib.Path) -> dict:
    """Builds the instances once, in this process (the jobs reuse them)."""
    from jonebit.apps.pretrain import _prepare_data

    ns = argparse.Namespace(corpus=[str(args.corpus)], vocab=str(args.vocab), vocab_size=None, seq_len=args.seq,
                            max_predictions=20, dupe_factor=args.dupe_factor, seed=0,
                            heldout_documents=args.heldout_documents, validation_documents=0, heldout_passes=1,
                            whole_word_mask=False, data_dir=str(work / "data"), overwrite_data=False)
    data_dir, vocab, _ = _prepare_data(ns, work)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    return {"data_dir": str(data_dir), "vocab": str(vocab), "instances": manifest["instances"],
            "masked_tokens": manifest["masked_tokens"]}


def run_arm(args, layout: Layout, cluster: Cluster, name: str, cfg: dict, data: dict, out: pathlib.Path) -> dict:
    """One ``jonebit pretrain`` job across the namespaces; returns its record."""
    from jonebit.plot import cumulative_bytes

    done = out / "done.json"
    if done.is_file():
        print(f"== {name}: finished earlier", flush=True)
        row = json.loads(done.read_text())
        metrics = out / "run" / "metrics.jsonl"
        if "stage_step_s" not in row and metrics.is_file():  # a row written before the medians were recorded
            row["stage_step_s"] = stage_step_seconds(
                [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()])
        return row
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", JONEBIT_NUM_PROCESSES=str(layout.hosts),
               JONEBIT_COORDINATOR=f"{layout.address(0)}:{COORDINATOR_PORT}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "jonebit", "pretrain", "--config", str(out / "config.json"), "--corpus",
            str(args.corpus), "--vocab", data["vocab"], "--data-dir", data["data_dir"], "--model", args.model,
            "--seq-len", str(args.seq), "--max-steps", str(args.steps), "--dupe-factor", str(args.dupe_factor),
            "--heldout-documents", str(args.heldout_documents), "--validation-documents", "0",
            "--heldout-passes", "1", "--eval-every", str(args.eval_every), "--output", str(out / "run")]
    before = cluster.counters()
    procs, logs = [], []
    print(f"\n== {name} ({layout.hosts} hosts, {cluster.rate})", flush=True)
    t0 = time.perf_counter()
    try:
        for i in range(layout.hosts):
            log = open(out / f"p{i}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen(
                ["timeout", "-s", "KILL", str(int(args.timeout)), *exec_prefix(layout, i), "env",
                 f"JONEBIT_PROCESS_ID={i}", *argv], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    wall = time.perf_counter() - t0
    if any(codes):
        tail = (out / "p0.log").read_text()[-3000:]
        raise RuntimeError(f"{name}: exit codes {codes}; process 0's log ends:\n{tail}")
    after = cluster.counters()
    records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    clock, prev, curve = 0.0, 0, []
    sent = float(cumulative_bytes(records)[-1])
    for r in records:
        clock += r["seconds"] * (r["step"] - prev)
        prev = r["step"]
        if "eval/mlm_loss" in r:
            curve.append((r["step"], clock, r["eval/mlm_loss"]))
    row = {"arm": name, "steps": records[-1]["step"], "wall_s": clock, "process_wall_s": wall,
           "first_step_s": records[0]["seconds"], "heldout_mlm_loss": records[-1]["eval/mlm_loss"],
           "heldout_masked_tokens": int(records[-1]["eval/masked_tokens"]), "bytes_sent_per_rank": sent,
           "qdisc_bytes_up": [a - b for a, b in zip(after["up"], before["up"], strict=True)],
           "curve": curve, "stages": sorted({r["stage"] for r in records}),
           "stage_step_s": stage_step_seconds(records)}
    done.write_text(json.dumps(row, indent=2) + "\n")
    print(f"== {name}: {row['wall_s']:.0f} s training wall-clock, held-out MLM loss {row['heldout_mlm_loss']:.3f}",
          flush=True)
    return row


def stage_step_seconds(records) -> dict:
    """Median seconds of one step per stage (``full``, ``warmup``, ``compression``, ...), each stage's first step
    (its compilation) left out."""
    import statistics

    by_stage: dict[str, list[float]] = {}
    for r in records:
        by_stage.setdefault(r["stage"], []).append(r["seconds"])
    return {k: statistics.median(v[1:] or v) for k, v in by_stage.items()}


def compare(adam: dict, onebit: dict) -> dict:
    """The two arms' times to two targets: Adam's final held-out loss (does 1-bit Adam reach it, and when?) and the
    higher of the two final losses, which both curves reach (how long each takes to get there)."""
    reached = time_to_loss(onebit["curve"], adam["heldout_mlm_loss"])
    common = max(adam["heldout_mlm_loss"], onebit["heldout_mlm_loss"])
    t_adam, t_onebit = time_to_loss(adam["curve"], common), time_to_loss(onebit["curve"], common)
    return {"target_loss": adam["heldout_mlm_loss"], "onebit_time_to_target_s": reached, "adam_time_s": adam["wall_s"],
            "speedup_to_target": None if reached is None else adam["wall_s"] / reached,
            "common_loss": common, "adam_time_to_common_s": t_adam, "onebit_time_to_common_s": t_onebit,
            "speedup_to_common": t_adam / t_onebit,
            "final_loss_gap": onebit["heldout_mlm_loss"] / adam["heldout_mlm_loss"] - 1.0,
            "wall_ratio": adam["wall_s"] / onebit["wall_s"]}


def time_to_loss(curve, target: float) -> float | None:
    """Wall-clock at which a ``(step, wall, loss)`` curve first reaches ``target`` (linear between points)."""
    prev = None
    for step, wall, loss in curve:
        if loss <= target:
            if prev is None or prev[2] == loss:
                return wall
            (_, w0, l0) = prev
            return w0 + (wall - w0) * (l0 - target) / (l0 - loss)
        prev = (step, wall, loss)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rates", nargs="+", default=["200mbit"])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=60)
    p.add_argument("--model", default="mini")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--freeze", type=float, default=0.2, help="1-bit Adam's warmup as a fraction of the steps")
    p.add_argument("--dupe-factor", type=int, default=2)
    p.add_argument("--heldout-documents", type=int, default=6)
    p.add_argument("--corpus", type=pathlib.Path, default=CORPUS)
    p.add_argument("--vocab", type=pathlib.Path, default=VOCAB)
    p.add_argument("--timeout", type=float, default=7200, help="seconds per job before it is killed")
    p.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/jonebit_time_to_loss"))
    p.add_argument("--tag", default="")
    p.add_argument("--cleanup", action="store_true", help="remove the leftovers of a killed run and exit")
    args = p.parse_args(argv)

    missing = missing_requirements()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.cleanup:
        from benchmarks.cluster.netns import DEFAULT_PREFIX
        from benchmarks.cluster.run import cleanup

        print(f"removed: {cleanup(DEFAULT_PREFIX)}")
        return 0
    for f in (args.corpus, args.vocab):
        if not f.is_file():
            print(f"no file at {f} (the corpus and vocabulary of ../shared/data, or --corpus/--vocab)", file=sys.stderr)
            return 2
    from benchmarks.report import result_path, run_meta

    args.workdir.mkdir(parents=True, exist_ok=True)
    data = prepare(args, args.workdir)
    cfgs = arm_configs(args.steps, args.batch, args.lr, args.freeze)
    layout = Layout(args.hosts)
    for rate in args.rates:
        rows = {}
        with Cluster(layout, rate) as cluster:
            for name, cfg in cfgs.items():
                rows[name] = run_arm(args, layout, cluster, name, cfg, data,
                                     args.workdir / f"{args.tag}{rate}" / name)
        adam, onebit = rows["adam"], rows["onebit_adam"]
        payload = {"meta": run_meta(), "rate": rate, "hosts": args.hosts, "model": args.model, "seq": args.seq,
                   "batch": args.batch, "steps": args.steps, "freeze": args.freeze, "data": data,
                   "arms": rows, **compare(adam, onebit)}
        path = result_path("time_to_loss", f"{args.tag}{rate}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            plt = None
        if plt is not None:
            fig, ax = plt.subplots(figsize=(6, 4))
            for name, row in rows.items():
                ax.plot([c[1] for c in row["curve"]], [c[2] for c in row["curve"]], marker="o", label=name)
            ax.axhline(adam["heldout_mlm_loss"], color="gray", lw=0.8, ls="--")
            ax.set(xlabel="training wall-clock (s)", ylabel="held-out MLM loss",
                   title=f"BERT-{args.model}, {args.hosts} hosts at {rate}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(path.with_suffix(".png"), dpi=120)
        reached = payload["onebit_time_to_target_s"]
        said = "never reached it" if reached is None else f"reached it after {reached:.0f} s " \
            f"({adam['wall_s'] / reached:.2f}x faster)"
        print(f"\n{rate}: Adam ends at {adam['heldout_mlm_loss']:.3f} after {adam['wall_s']:.0f} s; 1-bit Adam {said}; "
              f"both reach {payload['common_loss']:.3f}: Adam after {payload['adam_time_to_common_s']:.0f} s, 1-bit "
              f"Adam after {payload['onebit_time_to_common_s']:.0f} s ({payload['speedup_to_common']:.2f}x); "
              f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
