"""Tiny random pooling checkpoints built by transformers from configs (no downloads),
saved as safetensors with a real WordPiece tokenizer (``BertTokenizerFast`` over a small
vocabulary written here): BERT / XLM-R embedders and cross-encoders, and a Qwen3
decoder for last-token embedding."""

from __future__ import annotations

import os
import string

import torch
import transformers

from tests.models.tiny_models import randomize

WORDS = ("the a of and to in is it that for on with as was at by be this are from or "
         "an which one all were her she there can more if what about when how who paris "
         "france capital city bees make honey flowers nectar sky blue light sun water "
         "cats dogs run fast slow model text query document answer question").split()
VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(string.ascii_lowercase)
         + [f"##{c}" for c in string.ascii_lowercase] + list(".,?!'") + WORDS)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96, max_position_embeddings=130)


def save_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    os.makedirs(path, exist_ok=True)
    vocab = os.path.join(path, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=vocab, do_lower_case=True)
    tok.save_pretrained(path)
    return tok


def build_encoder(kind: str, path: str, seed: int = 3, **extra: object) -> torch.nn.Module:
    """``kind``: ``bert`` / ``xlm_roberta`` (embedders: ``*Model``) or ``bert_ce`` /
    ``xlm_roberta_ce`` (cross-encoders, one label).  Returns the HF model (eval)."""
    xlmr = kind.startswith("xlm_roberta")
    cfg_cls = transformers.XLMRobertaConfig if xlmr else transformers.BertConfig
    kw = dict(TINY, vocab_size=len(VOCAB), **extra)
    if xlmr:
        kw.update(pad_token_id=0, type_vocab_size=1)
    if kind.endswith("_ce"):
        kw["num_labels"] = 1
        hf_cls = (transformers.XLMRobertaForSequenceClassification if xlmr
                  else transformers.BertForSequenceClassification)
    else:
        hf_cls = transformers.XLMRobertaModel if xlmr else transformers.BertModel
    torch.manual_seed(seed)
    hf = hf_cls(cfg_cls(**kw)).eval()
    randomize(hf, seed)
    if kind.endswith("_ce"):
        # Spread the scores: sharper attention makes [CLS] depend on the text (random
        # weights attend almost uniformly), a larger last layer spreads the logits.
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if ".query." in name or ".key." in name:
                    p.mul_(4.0)
                elif name.startswith("classifier") and not name.startswith(
                        "classifier.dense"):
                    p.mul_(10.0)
    hf.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)
    return hf


def build_qwen3(path: str, seed: int = 9) -> torch.nn.Module:
    cfg = transformers.Qwen3Config(vocab_size=len(VOCAB), hidden_size=64,
                                   intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128,
                                   architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    randomize(hf, seed)
    hf.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)
    return hf
