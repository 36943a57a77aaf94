package client

import (
	"context"

	"github.com/lazyfork/lazyfork/node"
)

// FamilyInfo describes a family's memory files on the node (node.Family).
type FamilyInfo = node.Family

// Families reports every family in LazyFork's memory store, by name.
func (c *Client) Families() ([]FamilyInfo, error) {
	return c.node.Families(context.Background())
}
