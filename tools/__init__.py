"""Tools of the checkout that are not part of the installed package (see tools/bench)."""
