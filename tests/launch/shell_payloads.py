"""Hostile strings for the job-script tests: each mentions {m}, the marker file it would create if any
part of it ran as a command (format with m=<marker path>)."""

SINGLE_LINE = [
    "$(touch {m})",
    "`touch {m}`",
    "'; touch {m}; echo '",
    '"; touch {m}; echo "',
    ";touch {m}",
    "a b | touch {m} && touch {m}",
    "$((1+1)) ${{HOME}} \\$(touch {m}) \\",
    "--x=$(touch {m})",
    "#SBATCH --wrap='touch {m}'",
]
MULTI_LINE = [
    "x\ntouch {m}",
    "x\rtouch {m}",
    "x\n#SBATCH --wrap='touch {m}'\ntouch {m}",
]
