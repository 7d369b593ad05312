"""placeholder"""
def make(method, model, input_ids, budget, options):
    raise NotImplementedError(method)
