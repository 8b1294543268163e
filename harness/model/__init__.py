"""The α–β cost model: pricing plans on a described cluster, calibrating it here, predicting
and extrapolating, and validating predictions against measured records."""
