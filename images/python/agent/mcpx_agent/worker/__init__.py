"""A worker (the sandbox uid): the notebook shell, its output, figures, images and %pip."""
