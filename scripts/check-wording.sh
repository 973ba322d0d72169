#!/usr/bin/env bash
# Fails when a tracked file speaks of how the code came to be instead of what it is, or
# points outside the repository. Every tracked text file is checked (binary files such as
# data/traces/*.gz are skipped) against two lists of patterns below, written with bracket
# expressions so that this file does not match itself:
#   - history_words (case-insensitive): words that tell how the code came about;
#   - outside_refs (case-insensitive): planning notes that do not ship with the repository, absolute machine
#     paths (work, root and home directories) and links to a sibling shared directory.
#
#   scripts/check-wording.sh     # exit 0 when clean, 1 with the offending lines otherwise
set -euo pipefail
cd "$(dirname "$0")/.."

history_words='[t]he seed|[s]ession|[t]his stop'
outside_refs='DESIGN[.]md|ACL[_]SUBSET|/[w]ork/|/[r]oot/|/[h]ome/|[.][.]/[s]hared'

# -I skips binary files, -s files listed by git but absent from the working tree.
search() {
  git ls-files -z | xargs -0 grep -I -s -n -E "$@" || true
}

failed=0
words=$(search -i "$history_words")
if [[ -n "$words" ]]; then
  echo "check-wording: history words in tracked files (say what the code is, not how it came to be):"
  echo "$words"
  failed=1
fi
refs=$(search -i "$outside_refs")
if [[ -n "$refs" ]]; then
  echo "check-wording: references outside the repository in tracked files:"
  echo "$refs"
  failed=1
fi
if ((failed)); then
  exit 1
fi
echo "check-wording: clean ($(git ls-files | wc -l) tracked files)"
