package main

func (r *result) plot(path string) error { return nil }
