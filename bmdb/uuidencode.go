package bmdb

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// encodeUUIDsAsBytes makes conn send google/uuid's UUIDs as the 16 bytes
// they are. pgx does not know the type, so it falls back to its
// database/sql Value, a 36-character string, which it then parses back into
// 16 bytes for the binary protocol: per UUID, per parameter, per array
// element. In the heartbeat statement's machine id array that was about an
// eighth of the callback server's CPU per heartbeat (P1's profile).
func encodeUUIDsAsBytes(_ context.Context, conn *pgx.Conn) error {
	wrapUUIDs(conn.TypeMap())
	return nil
}

// wrapUUIDs adds tryWrapUUID to m, first: pgx's own wrappers skip a
// driver.Valuer, and the Valuer fallback comes after all of them.
func wrapUUIDs(m *pgtype.Map) {
	m.TryWrapEncodePlanFuncs = append([]pgtype.TryWrapEncodePlanFunc{tryWrapUUID}, m.TryWrapEncodePlanFuncs...)
}

// tryWrapUUID wraps a uuid.UUID as pgtype's UUIDValuer, which pgx's UUID
// codec encodes directly, in either format.
func tryWrapUUID(value any) (plan pgtype.WrappedEncodePlanNextSetter, nextValue any, ok bool) {
	if u, ok := value.(uuid.UUID); ok {
		return &uuidEncodePlan{}, uuidValue(u), true
	}
	return nil, nil, false
}

// uuidValue is a uuid.UUID as a pgtype.UUIDValuer.
type uuidValue uuid.UUID

// UUIDValue returns the UUID for pgx's UUID codec.
func (u uuidValue) UUIDValue() (pgtype.UUID, error) {
	return pgtype.UUID{Bytes: u, Valid: true}, nil
}

// uuidEncodePlan encodes a uuid.UUID with the plan of its uuidValue.
type uuidEncodePlan struct{ next pgtype.EncodePlan }

func (p *uuidEncodePlan) SetNext(next pgtype.EncodePlan) { p.next = next }

func (p *uuidEncodePlan) Encode(value any, buf []byte) ([]byte, error) {
	return p.next.Encode(uuidValue(value.(uuid.UUID)), buf)
}
