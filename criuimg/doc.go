// Package criuimg reads and writes the CRIU image files that a LazyFork
// rewrite touches.
//
// # Format
//
// A CRIU image file (CRIU 4.x) is:
//
//	[common magic (IMG_COMMON or IMG_SERVICE), optional] image magic
//	repeated: 4-byte little-endian length, protobuf payload
//
// pagemap-N.img starts with a pagemap_head entry (which names pages-<id>.img)
// followed by pagemap_entry records. pages-<id>.img is raw: the pages of every
// pagemap entry flagged PE_PRESENT, back to back, in pagemap order.
//
// The payloads use go-criu v7's generated types (CRIU 4.1.1 still has a 32-bit
// nr_pages; go-criu v8 follows CRIU 4.2). Decoding then encoding an image is
// byte-identical: tests prove it on dumps of real programs. go-criu's own crit
// reader is not used for memory because it ignores pagemap flags and in_parent.
//
// Every read uses io.ReadFull; a short file, a bad magic or a bad payload is an
// error that names the file, wrapped around errdefs.ErrDataLoss or
// errdefs.ErrInvalidArgument so callers can tell corruption from absence
// (errdefs.ErrNotFound).
package criuimg
