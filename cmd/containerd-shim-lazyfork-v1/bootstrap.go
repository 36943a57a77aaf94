package main

import (
	"errors"
	"strings"
	"unicode/utf8"
)

// The bootstrap protocol's messages (containerd's
// api/runtime/bootstrap/v1/bootstrap.proto), read and written by hand in the
// protobuf wire format: the front links no protobuf runtime. Tests hold both
// equal to containerd's generated code.

// params are the fields of BootstrapParams the front reads.
type params struct {
	instanceID  string // 1
	namespace   string // 2
	logLevel    int32  // 3
	grpcAddress string // 6
	socketDir   string // 9, optional
	// shimCgroup is set where an extension (8) of runc's Options type may
	// name a shim cgroup for a new shim (one does, or the front cannot tell):
	// runc's manager moves a new shim there, the front does not.
	shimCgroup bool
}

// logLevelDebug is LogLevel_LOG_LEVEL_DEBUG: at or below it, runc's manager
// runs the shim with -debug and a debug socket.
const logLevelDebug = -4

// runcOptionsType is the full name of runc's Options message
// (containerd.runc.v1.Options), which runc's manager looks for among the
// extensions.
const runcOptionsType = "containerd.runc.v1.Options"

var errWire = errors.New("malformed bootstrap parameters")

const (
	wireVarint = 0
	wireI64    = 1
	wireBytes  = 2
	wireI32    = 5
)

// decodeParams decodes a BootstrapParams message. It fails wherever
// protobuf-go's Unmarshal would (truncation, bad UTF-8 in a string, a
// malformed extension), and where it would not but the front does not know
// the encoding (groups): then the full shim decodes it.
func decodeParams(b []byte) (params, error) {
	var p params
	err := fields(b, func(num uint64, typ int, v []byte) error {
		if num == 3 && typ == wireVarint {
			x, _ := uvarint(v)
			p.logLevel = int32(x) // protobuf-go: an enum is the low 32 bits
			return nil
		}
		if typ != wireBytes {
			return nil
		}
		var dst *string
		switch num {
		case 1:
			dst = &p.instanceID
		case 2:
			dst = &p.namespace
		case 4, 5, 7: // containerd_version, _ttrpc_address, _binary
			if !utf8.Valid(v) {
				return errWire
			}
		case 6:
			dst = &p.grpcAddress
		case 8: // Extension{google.protobuf.Any value = 1}
			// Occurrences of value merge: its type_url and value are the
			// last ones seen.
			var typeURL string
			var value []byte
			err := fields(v, func(num uint64, typ int, v []byte) error {
				if num == 1 && typ == wireBytes {
					return anyMessage(v, &typeURL, &value)
				}
				return nil
			})
			if err == nil && anyIs(typeURL, runcOptionsType) && !noShimCgroup(value) {
				p.shimCgroup = true
			}
			return err
		case 9:
			dst = &p.socketDir
		}
		if dst != nil {
			if !utf8.Valid(v) {
				return errWire
			}
			*dst = string(v)
		}
		return nil
	})
	return p, err
}

// anyMessage reads a google.protobuf.Any{string type_url = 1; bytes value =
// 2} into typeURL and value, where it has them.
func anyMessage(b []byte, typeURL *string, value *[]byte) error {
	return fields(b, func(num uint64, typ int, v []byte) error {
		if typ != wireBytes {
			return nil
		}
		switch num {
		case 1:
			if !utf8.Valid(v) {
				return errWire
			}
			*typeURL = string(v)
		case 2:
			*value = v
		}
		return nil
	})
}

// anyIs is anypb's MessageIs: the type URL names message name.
func anyIs(url, name string) bool {
	if !strings.HasSuffix(url, name) {
		return false
	}
	return len(url) == len(name) || url[len(url)-len(name)-1] == '/'
}

// noShimCgroup reports whether runc's Options encoded in b surely name no
// shim cgroup (shim_cgroup = 3) and decode as runc's manager decodes them
// (valid UTF-8 in every string field).
func noShimCgroup(b []byte) bool {
	cgroup := false
	err := fields(b, func(num uint64, typ int, v []byte) error {
		if typ != wireBytes {
			return nil
		}
		switch num {
		case 3:
			cgroup = len(v) > 0 // the last occurrence wins
			fallthrough
		case 6, 7, 10, 11, 12: // binary_name, root, criu_*_path, task_api_address
			if !utf8.Valid(v) {
				return errWire
			}
		}
		return nil
	})
	return err == nil && !cgroup
}

// fields calls f for each field of a message: its number, wire type and,
// for the bytes type, its content (for the varint type, its encoding).
func fields(b []byte, f func(num uint64, typ int, v []byte) error) error {
	for len(b) > 0 {
		key, n := uvarint(b)
		if n == 0 {
			return errWire
		}
		b = b[n:]
		num, typ := key>>3, int(key&7)
		if num == 0 || num > 1<<29-1 {
			return errWire
		}
		var v []byte
		switch typ {
		case wireVarint:
			if _, n = uvarint(b); n == 0 {
				return errWire
			}
			v = b[:n]
		case wireI64:
			n = 8
		case wireI32:
			n = 4
		case wireBytes:
			l, m := uvarint(b)
			if m == 0 || l > uint64(len(b)-m) {
				return errWire
			}
			v, n = b[m:m+int(l)], m+int(l)
		default:
			return errWire
		}
		if n > len(b) {
			return errWire
		}
		b = b[n:]
		if err := f(num, typ, v); err != nil {
			return err
		}
	}
	return nil
}

// uvarint decodes a varint, returning its length (0: malformed).
func uvarint(b []byte) (uint64, int) {
	var x uint64
	for i := 0; i < len(b) && i < 10; i++ {
		c := b[i]
		if i == 9 && c > 1 {
			return 0, 0
		}
		x |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return x, i + 1
		}
	}
	return 0, 0
}

// encodeResult encodes the BootstrapResult runc's manager returns for a shim
// that already runs: version 3, the address, protocol "ttrpc".
func encodeResult(address string) []byte {
	const protocol = "ttrpc"
	out := make([]byte, 0, 2+1+10+len(address)+2+len(protocol))
	out = append(out, 1<<3|wireVarint, 3)
	out = appendBytes(out, 2, address)
	out = appendBytes(out, 3, protocol)
	return out
}

func appendBytes(out []byte, num uint64, s string) []byte {
	out = appendUvarint(out, num<<3|wireBytes)
	out = appendUvarint(out, uint64(len(s)))
	return append(out, s...)
}

func appendUvarint(out []byte, x uint64) []byte {
	for x >= 0x80 {
		out = append(out, byte(x)|0x80)
		x >>= 7
	}
	return append(out, byte(x))
}
