"""Figures of the lenses on training: the curvature rule's sharpness against 2/lr
(``curvature_plot``), a test example beside its most helpful and most harmful training examples
(``influence_plot``)."""
