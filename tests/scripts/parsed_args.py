"""A zero-change script's argument parser (Hugging Face-style flags, data files as positionals), and nothing else.

Prints what argparse made of its arguments as JSON, so a test can see which values the script would train with.
"""

import argparse
import json

p = argparse.ArgumentParser()
p.add_argument("--per_device_train_batch_size", type=int, default=64)
p.add_argument("--gradient_accumulation_steps", type=int, default=1)
p.add_argument("--bf16", action="store_true")
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("files", nargs="*")
print(json.dumps(vars(p.parse_args())))
