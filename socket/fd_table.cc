// placeholder: replaced by the fd table implementation
