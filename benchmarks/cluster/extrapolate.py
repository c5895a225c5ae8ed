"""The bandwidth model, validated on the emulated cluster, applied to BERT-Large on 40 Gbit/s Ethernet.

    step time = compute + bytes over one node's NIC / (rate x efficiency) + latency x message rounds

Setting (DeepSpeed's 1-bit Adam BERT-Large runs): sequence 128, global batch 4096, 8 GPUs per node sharing one
NIC, 16 to 64 nodes, no gradient accumulation (each GPU computes 4096 / GPUs sequences per step).

- **Compute** per GPU and step: ``6 N`` FLOPs per token (forward + backward of every parameter) plus
  ``6 L S H`` for the attention scores, at ``--mfu`` of the GPU's dense fp16/bf16 tensor peak (datasheet
  values: V100 SXM2 125, A100 SXM 312, H100 SXM 989 TFLOP/s). The utilisation is an assumption (``--mfu``,
  default 0.4: BERT-Large phase-1 pre-training in well-tuned stacks runs at roughly a third to a half of peak);
  the table is also given at 0.25 and 0.6 by ``--mfu``.
- **Bytes over a node's NIC**, from the collectives each scheme runs, counted by
  :func:`benchmarks.cluster.model.host_link_bytes` (rings cross each node boundary once, all-to-all sends an
  equal share to every other member) — the count the emulated cluster's qdisc counters confirmed to within
  5% (TCP/IP framing):

  - Adam: a ring all-reduce of the fp16 gradients over all GPUs (one crossing per node: ``2 (P-1)/P x 2N``);
  - flat 1-bit (DeepSpeed, and ``onebit_adam(axis_name="data")``): all-to-all of the sign-packed momentum
    chunks plus the all-gather of the compressed chunks, over all ``P = 8 x nodes`` GPUs. The all-to-all is
    not node-aware: each of the 8 GPUs of a node sends ``(P-8)/P`` of its ``N/8`` bytes off the node;
  - hierarchical 1-bit (``onebit_adam(axis_name=("hosts", "local"))``): fp32 reduce-scatter inside the node
    (NVLink, not on the NIC), compressed all-to-all + all-gather of each GPU's ``N/8`` shard across the nodes,
    uint8 all-gather inside the node.

  Compression and the momentum exchange run after the backward pass in both DeepSpeed and jonebit, so
  the model does not overlap communication with compute (for Adam either, which favours 1-bit Adam where
  a framework overlaps Adam's all-reduce with the backward pass).
- **Latency**: ``--latency-us`` per message round (ring all-reduce ``2 (P-1)`` rounds, all-gather /
  all-to-all ``P-1``), computed: the emulated links could not inject latency (no netem).

Writes ``results/extrapolate/extrapolate.json`` and ``results/extrapolate/extrapolate.png`` and prints the table.

    python benchmarks/cluster/extrapolate.py                      # the defaults above
    python benchmarks/cluster/extrapolate.py --mfu 0.25 --efficiency 0.5 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.cluster.model import host_link_bytes, message_rounds  # noqa: E402
from benchmarks.report import run_meta  # noqa: E402
from jonebit.comm import compressed_bytes_per_rank  # noqa: E402
from jonebit.comm.accounting import Collective  # noqa: E402
from jonebit.comm.compressed import padded_size  # noqa: E402
from jonebit.comm.hierarchical import shard_size  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "extrapolate"
PEAK_FLOPS = {"V100": 125e12, "A100": 312e12, "H100": 989e12}  # dense fp16/bf16 tensor, SXM datasheets
DEEPSPEED_REPORTED = {"compression_stage": 6.6, "end_to_end": 3.5}  # BERT-Large, 40 Gbit/s Ethernet
SCHEMES = ("adam", "onebit_flat", "onebit_hier")


def bert_large_params() -> int:
    """Parameters of jonebit's BertForPreTraining "large" preset (encoder, pooler, MLM and NSP heads)."""
    import jax
    from flax import nnx

    from jonebit.models.bert import BertConfig, BertForPreTraining

    model = nnx.eval_shape(lambda: BertForPreTraining(BertConfig.preset("large"), rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _compressed(n: int, group: tuple[int, ...]) -> list[Collective]:
    """The two collectives of one compressed allreduce of ``n`` floats over ``group`` (one device's view)."""
    p = len(group)
    row = padded_size(n, p) // p // 8 + 4  # one rank's packed chunk and its float32 scale
    return [Collective("all-to-all", p * row, p, "step", dtypes=("u8",)),
            Collective("all-gather", p * row, p, "step", dtypes=("u8",))]


def node_traffic(scheme: str, n: int, nodes: int, per_node: int) -> tuple[float, int]:
    """``(bytes over one node's NIC, message rounds)`` of one step of ``scheme``."""
    p = nodes * per_node
    hosts = [d // per_node for d in range(p)]
    everyone = (tuple(range(p)),)
    if scheme == "adam":
        ops = [Collective("all-reduce", 2 * n, p, "step", dtypes=("f16",), groups=everyone)]
        return host_link_bytes(ops, hosts), message_rounds(["all-reduce"], p)
    if scheme == "onebit_flat":
        ops = [_with_groups(c, everyone) for c in _compressed(n, everyone[0])]
        assert sum(c.bytes_sent for c in ops) == compressed_bytes_per_rank(n, p)
        return host_link_bytes(ops, hosts), message_rounds([c.op for c in ops], p)
    if scheme == "onebit_hier":
        s = shard_size(n, per_node)
        across = tuple(tuple(range(local, p, per_node)) for local in range(per_node))  # same local index
        ops = [_with_groups(c, across) for c in _compressed(s, across[0])]
        assert sum(c.bytes_sent for c in ops) == compressed_bytes_per_rank(s, nodes)
        return host_link_bytes(ops, hosts), message_rounds([c.op for c in ops], nodes)
    raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")


def _with_groups(c: Collective, groups) -> Collective:
    import dataclasses

    return dataclasses.replace(c, groups=groups)


def compute_seconds(n: int, gpu: str, mfu: float, seqs_per_gpu: float, seq: int, layers: int = 24,
                    hidden: int = 1024) -> float:
    flops = seqs_per_gpu * seq * (6 * n + 6 * layers * seq * hidden)
    return flops / (PEAK_FLOPS[gpu] * mfu)


def table(args, n: int) -> list[dict]:
    rows = []
    bits = args.gbit * 1e9 * args.efficiency
    for gpu in args.gpus:
        for nodes in args.nodes:
            p = nodes * args.gpus_per_node
            compute = compute_seconds(n, gpu, args.mfu, args.batch / p, args.seq)
            step = {}
            for scheme in SCHEMES:
                nic_bytes, rounds = node_traffic(scheme, n, nodes, args.gpus_per_node)
                comm = 8 * nic_bytes * args.framing / bits + args.latency_us * 1e-6 * rounds
                step[scheme] = dict(nic_bytes=nic_bytes, rounds=rounds, comm_s=comm, step_s=compute + comm)
            w = args.warmup_fraction
            adam = step["adam"]["step_s"]
            row = dict(gpu=gpu, nodes=nodes, gpus=p, seqs_per_gpu=args.batch / p, compute_s=compute, schemes=step)
            for scheme in ("onebit_flat", "onebit_hier"):
                comp = step[scheme]["step_s"]
                row[f"{scheme}_stage_speedup"] = adam / comp
                row[f"{scheme}_run_speedup"] = adam / (w * adam + (1 - w) * comp)  # warmup costs Adam's step
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| GPU | nodes x GPUs | seqs/GPU | compute s | Adam s (NIC GB) | flat 1-bit s (NIC GB) | "
           "hier 1-bit s (NIC GB) | compression stage vs Adam: flat / hier | whole run, 15% warmup: flat / hier |",
           "|---|---|---|---|---|---|---|---|---|"]
    def cell(r, k):
        return f"{r['schemes'][k]['step_s']:.3f} ({r['schemes'][k]['nic_bytes'] / 1e9:.3f})"

    for r in rows:
        out.append(f"| {r['gpu']} | {r['nodes']} x {r['gpus'] // r['nodes']} | {r['seqs_per_gpu']:g} | "
                   f"{r['compute_s']:.3f} | {cell(r, 'adam')} | "
                   f"{cell(r, 'onebit_flat')} | {cell(r, 'onebit_hier')} | {r['onebit_flat_stage_speedup']:.2f}x / "
                   f"{r['onebit_hier_stage_speedup']:.2f}x | {r['onebit_flat_run_speedup']:.2f}x / "
                   f"{r['onebit_hier_run_speedup']:.2f}x |")
    return "\n".join(out)


def plot(rows: list[dict], path: pathlib.Path) -> pathlib.Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for gpu in dict.fromkeys(r["gpu"] for r in rows):
        sel = [r for r in rows if r["gpu"] == gpu]
        nodes = [r["nodes"] for r in sel]
        line, = ax.plot(nodes, [r["onebit_flat_stage_speedup"] for r in sel], marker="o", label=f"{gpu} flat 1-bit")
        ax.plot(nodes, [r["onebit_hier_stage_speedup"] for r in sel], marker="s", linestyle="--",
                color=line.get_color(), label=f"{gpu} hierarchical 1-bit")
    ax.axhline(DEEPSPEED_REPORTED["compression_stage"], color="gray", linestyle=":",
               label="DeepSpeed reported (compression stage)")
    ax.set_xlabel("nodes (8 GPUs each, one 40 Gbit/s NIC)")
    ax.set_ylabel("compression-stage speedup over Adam")
    ax.set_title("BERT-Large, seq 128, batch 4096: model extrapolation")
    ax.set_xticks(sorted({r["nodes"] for r in rows}))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--gpus", nargs="+", default=list(PEAK_FLOPS), choices=list(PEAK_FLOPS))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gbit", type=float, default=40.0, help="NIC rate per node, Gbit/s")
    p.add_argument("--efficiency", type=float, default=1.0, help="fraction of the rate the collectives reach")
    p.add_argument("--framing", type=float, default=1.05, help="wire bytes per payload byte (TCP/IP, measured)")
    p.add_argument("--latency-us", type=float, default=20.0, help="seconds x 1e-6 per message round")
    p.add_argument("--mfu", type=float, default=0.4, help="fraction of the GPU's peak the compute reaches")
    p.add_argument("--batch", type=int, default=4096, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup-fraction", type=float, default=0.15)
    p.add_argument("--params", type=int, default=None, help="parameter count (default: jonebit's BERT-Large)")
    p.add_argument("--out", default=str(RESULTS / "extrapolate.json"))
    args = p.parse_args(argv)
    for name in ("gbit", "efficiency", "framing", "mfu"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.efficiency > 1 or args.mfu > 1:
        p.error("--efficiency and --mfu are fractions: at most 1")
    if not 0 <= args.warmup_fraction <= 1:
        p.error(f"--warmup-fraction must be in [0, 1], got {args.warmup_fraction}")
    if args.gpus_per_node < 1 or any(n < 2 for n in args.nodes):
        p.error("--gpus-per-node must be >= 1 and every --nodes >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    n = args.params or bert_large_params()
    rows = table(args, n)
    report = dict(meta=run_meta(), params=n, args=vars(args), deepspeed_reported=DEEPSPEED_REPORTED, rows=rows,
                  model=__doc__)
    print(f"BERT-Large, {n / 1e6:.1f}M parameters; {args.gbit:g} Gbit/s x {args.efficiency:g}, mfu {args.mfu:g}, "
          f"latency {args.latency_us:g} us")
    print(markdown(rows))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} and {plot(rows, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
