"""Who goes next and where: priority classes, fair share, slot shares, holds, replica placement.
Imports runtimes (the Backend seam), observe and the base modules."""
