"""The HTML report's Jinja2 templates and assets (installed as pipeline.templates)."""
