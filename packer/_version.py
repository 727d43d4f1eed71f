"""packer's one version string, in a module of its own: the build records it, and importing it from
``packer`` itself would load the package's lazy attributes (and the build) from inside the build."""

__version__ = "0.1.0"

#: The distribution's name on the package index (``pip install packer-datasets``): ``packer`` there is an
#: unrelated project. ``import packer`` and the ``packer`` command keep the short name.
DISTRIBUTION = "packer-datasets"
