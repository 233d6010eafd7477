"""Tools over the library: text and plot views, the demo, the environment report."""
