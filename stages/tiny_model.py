"""Stage `tiny_model`: the demo target (a random-weight Llama with a BPE tokenizer trained on the demo corpus)."""

from __future__ import annotations

from draftdata.config.load import cli
from draftdata.config.schema import TinyModelConfig
from draftdata.model.tiny import build_target


def main(cfg) -> None:
    tm: TinyModelConfig = cfg.tiny_model
    tokenizer = build_target(tm)
    print(f"tiny_model path={tm.path} vocab={len(tokenizer)} layers={tm.num_layers} hidden={tm.hidden_size}")


if __name__ == "__main__":
    cli(main, need_dataset=False)
