#!/usr/bin/env bash
# Twenty-sixth session, call 1 (H200). HHH: the Mosaic attend's partials of 2+ splits in f16
# and the cache's units, the merge scaling them ("mosaic-lib-half") beside the library's
# default ("mosaic-lib"), each checked against the jnp twin with the derived bound on every
# check case, then timed at 64x1 (2 splits a row) and decode-b1's one row (33 splits). And the
# converter diagnostics of benchmarks/attend_diag.py on the library's tuning (timing only:
# "diag-noload" loads no row, "diag-nostore" stores nothing), what paces the kernel's tiles.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
export PYTHONPATH=.
timeout 280 python3 benchmarks/h200_attend.py --groups mosaic-all --shapes ad --limit-s 270 --base mosaic-lib --variants mosaic-lib-half,diag-noload,diag-nostore --out $OUT/h200-attend.json 2>&1 | tail -30
