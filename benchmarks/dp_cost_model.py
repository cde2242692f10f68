"""Cost model of the data-parallel reduction, flat vs hierarchical: bytes over inter-node links, steps per bucket."""

from __future__ import annotations

import argparse

import torch

from benchmarks._lib import report
from lightning_gpipe.models.amoebanet import amoebanet_d
from lightning_gpipe.models.transformer import transformer_nmt_num_parameters

# A model, not a measurement (one machine cannot show inter-node links). Ring all-reduce over P ranks (gloo's and
# NCCL's ring): every rank sends 2(P − 1)/P of the buffer, in 2(P − 1) latency-bound steps. With N nodes of r
# replicas of a stage, ranks numbered node by node:
#
# - flat, P = N·r: the ring leaves each node once, so each node sends 2(Nr − 1)/(Nr) · S over its link, in
#   2(Nr − 1) steps;
# - hierarchical (Jizhi): reduce to the node's leader and broadcast back inside the node, a ring over the N leaders
#   between: 2(N − 1)/N · S per node over the link, in 2(N − 1) inter-node steps (plus the node's own).
#
# S is one stage's gradients (fp32, the parameters split evenly over K stages). Run: python -m benchmarks.dp_cost_model
# (--smoke: two node counts; --out-dir DIR)


def models() -> dict[str, int]:
    """Parameter counts of the examples' paper-scale models."""
    with torch.device("meta"):
        amoeba = sum(p.numel() for p in amoebanet_d(1000, 18, 256).parameters())
    return {
        "AmoebaNet-D (18, 256)": amoeba,
        "Transformer T(24, 8192, 16)": transformer_nmt_num_parameters(24, 8192, 1024, 32000),
        "Transformer T(64, 16384, 32)": transformer_nmt_num_parameters(64, 16384, 1024, 32000),
    }


def node_bytes(S: float, N: int, r: int, hierarchical: bool) -> float:
    """Bytes one node sends over its inter-node link for one all-reduce of S bytes."""
    P = N if hierarchical else N * r
    return 2 * (P - 1) / P * S if P > 1 else 0.0


def table(K: int, r: int, nodes: list[int]) -> list[dict[str, object]]:
    rows = []
    for name, params in models().items():
        S = 4 * params / K
        for N in nodes:
            flat, hier = node_bytes(S, N, r, False), node_bytes(S, N, r, True)
            rows.append(
                {
                    "model": name,
                    "K": K,
                    "replicas per node": r,
                    "nodes": N,
                    "stage gradients (MB)": S / 1e6,
                    "flat MB per node": flat / 1e6,
                    "hierarchical MB per node": hier / 1e6,
                    "bytes ratio flat/hier": flat / hier if hier else float("inf"),
                    "flat ring steps": 2 * (N * r - 1),
                    "hierarchical inter-node steps": 2 * (N - 1),
                }
            )
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--K", type=int, default=4)
    parser.add_argument(
        "--replicas-per-node", type=int, default=2, help="replicas of a stage on one node (8 GPUs, K=4)"
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--out-dir", "--out", dest="out_dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="2 and 4 nodes only")
    args = parser.parse_args()
    if args.smoke:
        args.nodes = [2, 4]
    rows = table(args.K, args.replicas_per_node, args.nodes)
    env, command = report.environment(), report.command_line("dp_cost_model")
    md = ["# Data-parallel reduction, flat vs hierarchical: a cost model (ring all-reduce), not a measurement", ""]
    md += [*report.environment_lines(env), f"- Command: `{command}`", "", markdown(rows)]
    data = {"command": command, "environment": env, "K": args.K, "replicas_per_node": args.replicas_per_node}
    paths = report.write("dp_cost_model", data | {"rows": rows}, "\n".join(md), out_dir=args.out_dir)
    print(markdown(rows))
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
