"""The weight-version store: publish, pull and list policy weight versions."""
