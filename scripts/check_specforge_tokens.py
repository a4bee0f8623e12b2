"""Does SpecForge's re-tokenization of a `specforge_online` export give our samples? Run it with the Python that has
SpecForge (it imports nothing of draftdata):

    python scripts/check_specforge_tokens.py <export dir> --model <target> --chat-template qwen [--train-only-last-turn]

`conversations.jsonl` goes through SpecForge's own preprocessing (specforge.data.preprocessing
`preprocess_conversations`, what `build_eagle3_dataset` maps over `data.train_data_path`; its `tools` parsed from
JSON as there) with the named template (`--template-json '{"assistant_header": ...}'` registers one of your own,
as SpecForge's TEMPLATE_REGISTRY documents), and each sample is compared with `prompts.jsonl`, our exact ids and loss
mask. Prints one JSON line: how many samples have the same ids, and of those the same loss mask; where our ids are
a prefix of theirs (a template that writes text after the last turn), the tokens each trains that the other does
not; and the first sample that differs, with where. Exit status 1 when any differs: then train from prompts.jsonl
(`data.prompts_path`), or fix the template until none does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export")
    p.add_argument("--model", required=True, help="the target's tokenizer (a directory or hub id)")
    p.add_argument("--chat-template", required=True, help="SpecForge's data.chat_template")
    p.add_argument("--template-json", help="register --chat-template from these ChatTemplate fields")
    p.add_argument("--train-only-last-turn", action="store_true", help="SpecForge's data.train_only_last_turn")
    p.add_argument("--max-length", type=int, default=1 << 20)
    args = p.parse_args()

    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate
    from transformers import AutoTokenizer

    if args.template_json:
        TEMPLATE_REGISTRY.register(args.chat_template, ChatTemplate(**json.loads(args.template_json)), override=True)
    template = TEMPLATE_REGISTRY.get(args.chat_template)
    tok = AutoTokenizer.from_pretrained(args.model)
    export = Path(args.export)
    ours = {}
    with open(export / "prompts.jsonl") as f:
        for line in f:
            row = json.loads(line)
            ours[row["id"]] = (row["input_ids"][: args.max_length], row["loss_mask"][: args.max_length])
    report = {"samples": 0, "same_ids": 0, "same_ids_and_mask": 0, "ours_prefix_of_theirs": 0, "first": None}
    # where ours is a prefix of theirs: tokens trained, and our trained spans (answers)
    trained = dict.fromkeys(("ours", "theirs", "ours_only", "theirs_only", "our_spans"), 0)
    with open(export / "conversations.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            tools = json.loads(rec["tools"]) if rec.get("tools") else []
            got = preprocess_conversations(
                tok, [rec["conversations"]], template, args.max_length, False, args.train_only_last_turn, [tools]
            )
            ids, mask = got["input_ids"][0][0].tolist(), got["loss_mask"][0][0].tolist()
            want_ids, want_mask = ours[rec["id"]]
            report["samples"] += 1
            report["same_ids"] += ids == want_ids
            report["same_ids_and_mask"] += ids == want_ids and mask == want_mask
            if ids[: len(want_ids)] == want_ids:  # a template that adds text after the last turn
                report["ours_prefix_of_theirs"] += 1
                padded = want_mask + [0] * (len(mask) - len(want_mask))
                trained["ours"] += sum(want_mask)
                trained["theirs"] += sum(mask)
                trained["ours_only"] += sum(a and not b for a, b in zip(padded, mask))
                trained["theirs_only"] += sum(b and not a for a, b in zip(padded, mask))
                trained["our_spans"] += sum(m and not p for p, m in zip([0] + want_mask, want_mask))
            if report["first"] is None and not (ids == want_ids and mask == want_mask):
                what = "input_ids" if ids != want_ids else "loss_mask"
                at = first_difference(ids, want_ids) if ids != want_ids else first_difference(mask, want_mask)
                report["first"] = {"id": rec["id"], "differs_in": what, "at": at, "theirs": ids, "ours": want_ids}
                report["first"] |= {"their_mask": mask, "our_mask": want_mask}
    report["trained_tokens"] = trained
    print(json.dumps(report))
    return 0 if report["same_ids_and_mask"] == report["samples"] == len(ours) else 1


if __name__ == "__main__":
    sys.exit(main())
