// Package fileextent lists where a file holds data (SEEK_DATA/SEEK_HOLE),
// once per file: on tmpfs a SEEK_HOLE walks the page cache from its offset
// to the end of the data it starts in, so asking per range of a large file
// costs the rest of the extent every time (seconds for thousands of ranges
// of a moved heap). memfile's rewrite and rehome's consolidation both copy
// ranges of memory files, holes kept.
package fileextent
