"""--retie: the rules (what is rewritten and what left), the rewrite and its graph edits, the int4 forms, and
writing a proven file or folder."""
