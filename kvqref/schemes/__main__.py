"""``python3 -m kvqref.schemes``: the engine profile table and the relative-RMS table of docs/schemes.md."""

from kvqref.schemes import error_table_markdown
from kvqref.schemes.profiles import profiles_markdown

print(profiles_markdown())
print()
print(error_table_markdown())
