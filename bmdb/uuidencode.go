package bmdb

import (
	"context"

	"github.com/jackc/pgx/v5"
	pgxuuid "github.com/vgarvardt/pgx-google-uuid/v5"
)

// encodeUUIDsAsBytes makes conn send and read google/uuid's UUIDs as the 16
// bytes they are. Left to itself pgx does not know the type, so it falls
// back to its database/sql Value, a 36-character string, which it then
// parses back into 16 bytes for the binary protocol: per UUID, per
// parameter, per array element. In the heartbeat statement's machine id
// array that was about an eighth of the callback server's CPU per heartbeat
// (P1's profile). pgx-google-uuid is the integration pgx's documentation
// names for the type.
func encodeUUIDsAsBytes(_ context.Context, conn *pgx.Conn) error {
	pgxuuid.Register(conn.TypeMap())
	return nil
}
