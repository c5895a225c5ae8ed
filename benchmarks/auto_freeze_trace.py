"""How 1-bit Adam's variance settles on the embedded tiny-BERT pre-training: the data behind ``AutoFreeze``'s rule.

Trains the setup of ``defaults_convergence.py`` (same data, seed, schedule, clipping) with 1-bit Adam kept in warmup
(what ``freeze_step="auto"`` computes until its rule fires) and records every tensor's ``||v||`` after every update.
For each check interval it reports the relative change between checks of the three statistics of ``AutoFreeze``
(the median and the largest over the tensors, and the whole model's norm), on the bias-corrected ``||v / (1 - b2^t)||``
that the rule reads and, for comparison, on the raw ``||v||``, and the update at which a rule on each would fire for
the given ``--thresholds``/``--patience``/``--min-step``. The JSON keeps the raw norms at every check.

    python benchmarks/auto_freeze_trace.py --steps 300 --check-every 10   # results/auto_freeze_trace/*.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.common import write_json  # noqa: E402  (sets 8 CPU devices)


def fire_point(changes, check_every, threshold, patience, min_step, steps):
    """The update a rule on one statistic fires at (checks every ``check_every``; ``changes[j]``: the change at check
    ``j + 1``, i.e. between updates ``(j + 1) * check_every`` and ``(j + 2) * check_every``)."""
    calm = 0
    for j, c in enumerate(changes):
        done = (j + 2) * check_every
        calm = calm + 1 if c < threshold else 0
        if calm >= patience and done >= min_step:
            return done
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=10)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--min-step", type=int, default=20)
    ap.add_argument("--workdir", default="runs/auto_freeze_trace")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jonebit.apps.pretrain import _prepare_data, build_model, default_configs, make_loss
    from jonebit.data.pretraining import PretrainingData
    from jonebit.data.tokenization import load_wordpiece
    from jonebit.models.bert import position_embedding_mask
    from jonebit.train.config import load_config
    from jonebit.train.initialize import initialize

    work = pathlib.Path(args.workdir)
    prep = argparse.Namespace(corpus=None, vocab=None, vocab_size=2000, seq_len=args.seq_len, max_predictions=20,
                              dupe_factor=5, seed=args.seed, heldout_documents=6, whole_word_mask=False,
                              data_dir=None, overwrite_data=False)
    data_dir, vocab, _ = _prepare_data(prep, work)
    cfg = default_configs(args.steps, args.batch_size, lr=args.lr)["onebit_adam"]
    cfg["optimizer"]["params"]["freeze_step"] = 10 ** 6  # warmup throughout: Adam on the mean gradient
    tokenizer = load_wordpiece(vocab)
    net = build_model("tiny", tokenizer.vocab_size, args.seq_len, args.seed)
    graphdef, params, keys, rest = nnx.split(net, nnx.Param, nnx.RngState, ...)
    engine = initialize(load_config(cfg), make_loss(graphdef, keys, rest), params,
                        exp_avg_mask=position_embedding_mask(params, args.seq_len), rng_seed=args.seed, fused=False)
    batches = PretrainingData(data_dir, "train").batches(engine.batch.train_batch_size, seed=args.seed)

    def find(state):
        return next(n for n in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "nu")) if hasattr(n, "nu"))

    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(find(engine.state.opt_state).nu)]
    norms_of = jax.jit(lambda nu: jnp.stack([jnp.sqrt(jnp.sum(v * v)) for v in jax.tree.leaves(nu)]))
    trace = []
    for t in range(args.steps):
        engine.state, _ = engine.step(engine.state, next(batches))
        trace.append(np.asarray(norms_of(find(engine.state.opt_state).nu), np.float64))
        if (t + 1) % 50 == 0:
            print(f"update {t + 1}", flush=True)
    trace = np.stack(trace)  # (steps, tensors): the raw ||v|| after every update
    ce = args.check_every
    b2 = float(cfg["optimizer"]["params"].get("betas", [0.9, 0.999])[1])
    done = np.arange(ce, args.steps + 1, ce)
    raw = trace[ce - 1::ce]  # after updates ce, 2 ce, ...
    corrected = raw / (1.0 - b2 ** done)[:, None]  # what AutoFreeze reads

    def statistics(checks):
        rel = np.abs(np.diff(checks, axis=0)) / np.where(checks[:-1] > 0, checks[:-1], 1.0)
        glob = np.sqrt(np.sum(checks ** 2, axis=1))
        return rel, {"max": rel.max(axis=1), "median": np.median(rel, axis=1),
                     "global": np.abs(np.diff(glob)) / glob[:-1]}

    rel, stats = statistics(corrected)
    _, stats_raw = statistics(raw)

    def fires_of(st):
        return {name: {str(th): fire_point(s, ce, th, args.patience, args.min_step, args.steps)
                       for th in args.thresholds} for name, s in st.items()}

    fires, fires_raw = fires_of(stats), fires_of(stats_raw)
    worst = [names[i] for i in np.argsort(-rel[len(rel) // 2:].mean(axis=0))[:5]]
    print("bias-corrected ||v|| (AutoFreeze) | raw ||v||")
    print("check  max     median  global | max     median  global")
    for j in range(len(rel)):
        print(f"{(j + 2) * ce:5d}  " + "   ".join(f"{stats[k][j]:.3f}" for k in ("max", "median", "global"))
              + " | " + "   ".join(f"{stats_raw[k][j]:.3f}" for k in ("max", "median", "global")))
    print("fires at (update), corrected:", json.dumps(fires))
    print("fires at (update), raw:", json.dumps(fires_raw))
    print("tensors moving most in the second half:", worst)
    write_json("auto_freeze_trace", {
        "steps": args.steps, "check_every": ce, "patience": args.patience, "min_step": args.min_step, "b2": b2,
        "changes": {k: [float(x) for x in v] for k, v in stats.items()}, "fires_at": fires,
        "changes_raw": {k: [float(x) for x in v] for k, v in stats_raw.items()}, "fires_at_raw": fires_raw,
        "moving_most": worst, "tensors": names, "raw_norms_at_checks": raw.tolist()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
