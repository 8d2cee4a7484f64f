"""embed.py's parts, one job each, standard library only: `tables`, `scores`, `precision`, `walkthrough`.
Import them through `embed`, the reference's one public face."""
