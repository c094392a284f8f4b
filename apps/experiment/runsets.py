"""Which runs of a folder are repeats of one configuration, and the names plots give them (commands/plot.py draws
them; nothing here draws).  Runs are repeats only where every configuration field (records.CONFIG_KEYS) but the
seed is equal: a Budget with and without offloading are two configurations, never one bar spread between them."""
import json

from .records import CONFIG_KEYS
from .setup import POLICIES


def run_label(r):
    """A run's curve or bar: its policy, with what sets it apart where it has one (its segment length; a budget's
    bound, offloading and planned bandwidth), so that no two configurations share a name."""
    policy = r.get("label") or r.get("policy") or ("all" if r.get("use_gc") else "off")
    base = policy_base(policy)
    parts = [policy]
    if base == "all" and r.get("segment_len") and r.get("sweep_over") != "segment_len":
        parts.append(f"segment_len {r['segment_len']}")
    if base == "budget" and r.get("budget_bytes"):
        parts[0] = f"{policy} {r['budget_bytes'] / 2**20:g} MiB"
        if r.get("budget_offload"):
            parts.append("offload")
        if r.get("host_bandwidth_bytes_per_second"):
            parts.append(f"{r['host_bandwidth_bytes_per_second'] / 1e9:g} GB/s")
    return ", ".join(parts)


def policy_base(label):
    """The policy a label starts with: "budget" of "budget+compress8 48 MiB, offload"."""
    return label.split(",")[0].split(" ")[0].split("+")[0]


def ordered_labels(labels):
    """The distinct labels in the policies' order ("off" first), then by name."""
    rank = lambda label: POLICIES.index(policy_base(label)) if policy_base(label) in POLICIES else 99  # noqa: E731
    return sorted(set(labels), key=lambda label: (rank(label), label))


# The fields that make one bar of a run set apart from the next: its policy and what that policy is given.  The
# other configuration fields (records.CONFIG_KEYS) make the run set, one PNG; none of them is compared for gc off.
POLICY_KEYS = ("policy", "use_gc", "label", "segment_len", "budget_bytes", "budget_offload",
               "host_bandwidth_bytes_per_second", "compress_bits")


def run_set_key(r):
    """What a run set's runs share: every configuration field but the policy's (and the seed: repeats)."""
    return tuple((k, json.dumps(r.get(k))) for k in CONFIG_KEYS if k not in POLICY_KEYS)


def bar_key(r):
    """What the runs of one bar share: the run set and the policy's fields (gc off has none)."""
    policy = () if run_label(r) == "off" else tuple((k, json.dumps(r.get(k))) for k in POLICY_KEYS)
    return run_set_key(r) + policy


def counts_text(counts, word):
    """"2 repeats" where every curve point or bar has as many; else the range, "1-4 repeats", never a count that
    only some have."""
    low, high = min(counts), max(counts)
    return f"{high} {word}{'s' * (high != 1)}" if low == high else f"{low}-{high} {word}s"
