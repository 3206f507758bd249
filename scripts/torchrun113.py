#!/usr/bin/python3
"""torchrun for Debian's PyTorch 1.13 on Python 3.11 (test helper).

Usage: python3 scripts/torchrun113.py [torchrun options] prog [args...]

Debian's /usr/bin/torchrun crashes in
torch.distributed.elastic.multiprocessing.api.to_map with
"'NoneType' object has no attribute 'get'": Std.from_str maps "0" (and "3")
to None because, since Python 3.11, iterating an IntFlag skips the zero
member and multi-bit aliases (NONE=0, ALL=3). The patch below makes
Std.from_str build members with Std(int(v)) instead.

Second, 1.13's argument parser only knows the underscore spellings
(--nproc_per_node, --no_python, ...); 2.x accepts both. We add the dashed
spellings as aliases so the same command line works with either version.
"""
import re
import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing import api


def _from_str(cls, vm):
    if re.match(api._VALUE_REGEX, vm):
        return cls(int(vm))
    if re.match(api._MAPPING_REGEX, vm):
        return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
    raise ValueError(f"{vm} does not match: <{api._VALUE_REGEX}> or <{api._MAPPING_REGEX}>")


api.Std.from_str = classmethod(_from_str)

_get_args_parser = run.get_args_parser


def _get_args_parser_with_dashes():
    parser = _get_args_parser()
    for action in parser._actions:
        for opt in list(action.option_strings):
            dashed = opt[:2] + opt[2:].replace("_", "-")
            if opt.startswith("--") and dashed not in parser._option_string_actions:
                action.option_strings.append(dashed)
                parser._option_string_actions[dashed] = action
    return parser


run.get_args_parser = _get_args_parser_with_dashes

if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    sys.exit(run.main(sys.argv[1:]))
