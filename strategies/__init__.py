from strategies.base import *
