package memfile

import (
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/inventory"
	"github.com/lazyfork/lazyfork/criuimg"
	"golang.org/x/sys/unix"
)

// networkLockSkip is CRIU's NETWORK_LOCK_SKIP (criu/include/cr_options.h):
// a restore takes its lock method from the dump's inventory.
const networkLockSkip = 2

// TCP states a restore may leave alone (include/net/tcp_states.h).
const (
	tcpClose  = 7
	tcpListen = 10
)

// holdsTCPConnections reports whether the image has a TCP socket that is
// neither listening nor closed: one CRIU repairs at restore (--tcp-established).
func holdsTCPConnections(files *criuimg.FilesImage) bool {
	for _, fe := range files.Entries {
		if fe.GetType() != fdinfo.FdTypes_INETSK {
			continue
		}
		sk := fe.GetIsk()
		if sk.GetProto() == unix.IPPROTO_TCP && sk.GetState() != tcpListen && sk.GetState() != tcpClose {
			return true
		}
	}
	return false
}

// inventorySkippingNetworkLock returns the image's inventory changed so that
// its restores skip CRIU's network lock, or nil when the image holds TCP
// connections or skips it already. For a task with its own network namespace
// the lock and unlock run iptables-restore four to eight times per restore
// (about 70 ms here); they only keep packets away from connections CRIU
// repairs.
func inventorySkippingNetworkLock(imageDir string, files *criuimg.FilesImage) (*criuimg.Image, error) {
	if holdsTCPConnections(files) {
		return nil, nil
	}
	img, err := criuimg.ReadImage(criuimg.InventoryPath(imageDir), criuimg.MagicInventory, criuimg.Of(&inventory.InventoryEntry{}))
	if err != nil {
		return nil, err
	}
	inv := img.Entries[0].(*inventory.InventoryEntry)
	if inv.NetworkLockMethod != nil && inv.GetNetworkLockMethod() == networkLockSkip {
		return nil, nil
	}
	inv.NetworkLockMethod = ptr(uint32(networkLockSkip))
	return img, nil
}
