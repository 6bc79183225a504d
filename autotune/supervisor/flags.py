"""Which of a script's own flags carry each plan knob: `--map KNOB=FLAG[=VALUE]`, and presets for known launchers.

`micro_batch` and `accumulation` take the plan's numbers (`--map micro_batch=--per_device_train_batch_size`).
`checkpointing`, `bf16` and `compile` are switches: a plain flag is present when the knob is on and absent
when off (`--map bf16=--bf16`); a flag with a value template is passed with that value when on
(`--map bf16=--trainer.precision=bf16-mixed` passes `--trainer.precision=bf16-mixed`) and dropped when
off, so the script's own default applies. Either way the script's own setting of a mapped flag is
replaced by the plan's.

A preset is a named set of maps for a launcher whose flags are known (`PRESETS`); `--map` entries given
beside it override the preset's entry for the same knob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..configuration import Rung
from ..errors import InvalidSetting

NUMBER_KNOBS = ("micro_batch", "accumulation")
SWITCH_KNOBS = ("checkpointing", "bf16", "compile")
MAP_KEYS = NUMBER_KNOBS + SWITCH_KNOBS
_BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "on", "off"}  # an optional value after a switch


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    maps: tuple[str, ...]
    about: str  # one line for `autotune run --help`
    example: str


PRESETS: dict[str, Preset] = {
    "hf-trainer": Preset(
        maps=("micro_batch=--per_device_train_batch_size", "accumulation=--gradient_accumulation_steps",
              "checkpointing=--gradient_checkpointing", "bf16=--bf16", "compile=--torch_compile"),
        about="Hugging Face TrainingArguments (Trainer, TRL, HfArgumentParser scripts)",
        example="autotune run --preset hf-trainer --global-batch-size 64 train.py --output_dir out"),
    "lightning-cli": Preset(
        maps=("micro_batch=--data.batch_size", "accumulation=--trainer.accumulate_grad_batches",
              "bf16=--trainer.precision=bf16-mixed"),
        about="LightningCLI scripts whose DataModule takes batch_size (checkpointing is the model's own: add "
              "--map checkpointing=--model.FLAG=true)",
        example="autotune run --preset lightning-cli --global-batch-size 64 train.py fit --trainer.max_steps 100"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Switch:
    """A knob that is on or off: `flag` alone, or `flag=value` when a value template was given."""

    flag: str
    value: str | None = None

    def tokens(self, on: bool) -> list[str]:
        if not on:
            return []
        return [self.flag] if self.value is None else [f"{self.flag}={self.value}"]

    def __str__(self) -> str:
        return self.flag if self.value is None else f"{self.flag}={self.value}"


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagMap:
    """Which of the script's flags carry each plan knob."""

    micro_batch: str
    accumulation: str
    checkpointing: Switch | None = None
    bf16: Switch | None = None
    compile: Switch | None = None

    @classmethod
    def parse(cls, entries: Sequence[str], preset: str | None = None) -> FlagMap:
        """From a preset's maps and `--map` values such as "micro_batch=--per_device_train_batch_size"."""
        found: dict[str, str] = {}
        for entry in preset_maps(preset):
            found[_split(entry)[0]] = entry
        given: dict[str, str] = {}
        for entry in entries:
            key = _split(entry)[0]
            if key in given:
                raise InvalidSetting(f"--map {key} is given twice ({given[key]} and {entry}); give it once")
            given[key] = found[key] = entry
        missing = [k for k in NUMBER_KNOBS if k not in found]
        if missing:
            raise InvalidSetting(
                f"zero-change mode needs --map {missing[0]}=FLAG (both micro_batch and accumulation): e.g. "
                "--map micro_batch=--per_device_train_batch_size --map accumulation=--gradient_accumulation_steps"
                f", or a --preset ({', '.join(PRESETS)})")
        knobs: dict[str, object] = {}
        for entry in found.values():
            key, flag, value = _split(entry)
            knobs[key] = flag if key in NUMBER_KNOBS else Switch(flag=flag, value=value)
        return cls(**knobs)  # type: ignore[arg-type]

    def apply(self, args: Sequence[str], *, micro: int, accumulation: int, rung: Rung) -> list[str]:
        """The script's arguments with every mapped flag replaced by the plan's value.

        The plan's flags go before a bare `--`, since a parser reads everything after it as positionals.
        """
        options, rest = _split_options(args)
        out = [*self.unmapped(options), self.micro_batch, str(micro), self.accumulation, str(accumulation)]
        for switch, on in ((self.checkpointing, rung.checkpointing != "none"), (self.bf16, rung.precision == "bf16"),
                           (self.compile, rung.compile)):
            if switch is not None:
                out += switch.tokens(on)
        return out + rest

    def unmapped(self, args: Sequence[str]) -> list[str]:
        """The script's arguments without any mapped flag (or its value): what the plan does not decide.

        Arguments after a bare `--` are positionals, kept as they are even when one spells a mapped flag.
        """
        options, rest = _split_options(args)
        out = _without(options, self.micro_batch, takes_value=True)
        out = _without(out, self.accumulation, takes_value=True)
        for switch in self.switches():
            out = _without(out, switch.flag, takes_value=switch.value is not None)
        return out + rest

    def switches(self) -> list[Switch]:
        return [s for s in (self.checkpointing, self.bf16, self.compile) if s is not None]

    def describe(self) -> list[str]:
        """Each mapped knob as KNOB=FLAG[=VALUE], as `--map` takes it."""
        knobs = {"micro_batch": self.micro_batch, "accumulation": self.accumulation,
                 "checkpointing": self.checkpointing, "bf16": self.bf16, "compile": self.compile}
        return [f"{k}={v}" for k, v in knobs.items() if v is not None]

    def global_batch(self, args: Sequence[str], world_size: int) -> int | None:
        """micro x accumulation x world size from the script's own arguments, when both are given."""
        options, _ = _split_options(args)
        micro = _value_of(options, self.micro_batch)
        accumulation = _value_of(options, self.accumulation)
        if micro is None or accumulation is None:
            return None
        return micro * accumulation * world_size


def preset_maps(name: str | None) -> tuple[str, ...]:
    """The `--map` entries of preset `name` (none for None); an unknown name lists the known ones."""
    if name is None:
        return ()
    if name not in PRESETS:
        raise InvalidSetting(f"--preset {name!r} is not known; pass one of {', '.join(PRESETS)}, or name the "
                             "script's flags with --map KNOB=FLAG")
    return PRESETS[name].maps


def _split(entry: str) -> tuple[str, str, str | None]:
    """"bf16=--trainer.precision=bf16-mixed" -> ("bf16", "--trainer.precision", "bf16-mixed")."""
    key, sep, rest = entry.partition("=")
    key = key.strip().replace("-", "_")
    flag, has_value, value = rest.partition("=")
    if not sep or key not in MAP_KEYS or not flag.startswith("-"):
        raise InvalidSetting(
            f"--map {entry!r}: write KNOB=FLAG with KNOB one of {', '.join(MAP_KEYS)} and FLAG the script's own "
            "flag, e.g. --map micro_batch=--per_device_train_batch_size; a switch that takes a value adds it: "
            "--map bf16=--trainer.precision=bf16-mixed")
    if has_value and key in NUMBER_KNOBS:
        raise InvalidSetting(f"--map {entry!r}: {key} takes the plan's number, so give the flag alone: "
                             f"--map {key}={flag}")
    if has_value and not value:
        raise InvalidSetting(f"--map {entry!r}: the value after {flag}= is empty; write e.g. "
                             f"--map {key}={flag}=true, or --map {key}={flag} for a plain switch")
    return key, flag, value if has_value else None


def _split_options(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the arguments before the first bare `--`, the `--` and everything after it)."""
    args = list(args)
    end = args.index("--") if "--" in args else len(args)
    return args[:end], args[end:]


def _without(args: Sequence[str], flag: str, *, takes_value: bool) -> list[str]:
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == flag:
            nxt = args[i + 1] if i + 1 < len(args) else None
            skip = takes_value or (nxt is not None and nxt.lower() in _BOOL_WORDS)
            continue
        if arg.startswith(flag + "="):
            continue
        out.append(arg)
    return out


def _value_of(args: Sequence[str], flag: str) -> int | None:
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    try:
        return int(value) if value is not None else None
    except ValueError:
        raise InvalidSetting(f"the script's {flag} is {value!r}, not an integer") from None
