#!/usr/bin/env bash
# Times the parts of `make test`: `timed.sh LABEL COMMAND...` runs COMMAND, appends its label,
# exit status and wall-clock seconds to $TIMES (default target/test-times.tsv) and exits with
# its status; `timed.sh --report` prints the parts so far as a table with their total.
set -uo pipefail
TIMES=${TIMES:-target/test-times.tsv}

if [[ "${1:-}" == --report ]]; then
	[[ -f "$TIMES" ]] || { echo "timed: no times recorded in $TIMES" >&2; exit 1; }
	awk -F'\t' '{ printf "  %-22s %6.0f s  %s\n", $1, $3, ($2 == 0 ? "" : "exit " $2); total += $3 }
		END { printf "  %-22s %6.0f s (%.1f min)\n", "total", total, total / 60 }' "$TIMES"
	exit 0
fi
if [[ $# -lt 2 ]]; then
	echo "usage: timed.sh LABEL COMMAND... | timed.sh --report" >&2
	exit 2
fi
label=$1
shift
mkdir -p "$(dirname "$TIMES")"
start=$(date +%s%N)
"$@"
status=$?
end=$(date +%s%N)
ms=$(((end - start) / 1000000))
printf '%s\t%d\t%d.%03d\n' "$label" "$status" $((ms / 1000)) $((ms % 1000)) >>"$TIMES"
exit "$status"
