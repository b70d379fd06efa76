package bmdb

import (
	"bytes"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
	pgxuuid "github.com/vgarvardt/pgx-google-uuid/v5"
)

// TestUUIDsEncodeAsBytes: with pgx-google-uuid registered (as
// encodeUUIDsAsBytes does) a uuid.UUID parameter, alone or in an array,
// encodes as pgx encodes its own 16-byte UUIDs, without the database/sql
// detour through a string (20 allocations per UUID in an array before,
// where the registered plan makes 2), and the text format still reads as
// the UUID.
// (Not parallel: testing.AllocsPerRun refuses to run in a parallel test.)
func TestUUIDsEncodeAsBytes(t *testing.T) {
	ids := make([]uuid.UUID, 1000)
	native := make([][16]byte, len(ids))
	for i := range ids {
		ids[i] = uuid.New()
		native[i] = ids[i]
	}
	m := pgtype.NewMap()
	pgxuuid.Register(m)
	want, err := m.Encode(pgtype.UUIDArrayOID, pgtype.BinaryFormatCode, native, nil)
	if err != nil {
		t.Fatal(err)
	}
	plan := m.PlanEncode(pgtype.UUIDArrayOID, pgtype.BinaryFormatCode, ids)
	if plan == nil {
		t.Fatal("no plan to encode []uuid.UUID")
	}
	var got []byte
	allocs := testing.AllocsPerRun(10, func() {
		if got, err = plan.Encode(ids, got[:0]); err != nil {
			t.Fatal(err)
		}
	})
	if !bytes.Equal(got, want) {
		t.Error("[]uuid.UUID encodes unlike the same UUIDs as [16]byte")
	}
	if per := allocs / float64(len(ids)); per > 4 {
		t.Errorf("%.1f allocations per UUID encoded: the database/sql string detour (20) is back", per)
	}
	for _, format := range []int16{pgtype.BinaryFormatCode, pgtype.TextFormatCode} {
		b, err := m.Encode(pgtype.UUIDOID, format, ids[0], nil)
		if err != nil {
			t.Fatal(err)
		}
		w := ids[0][:]
		if format == pgtype.TextFormatCode {
			w = []byte(ids[0].String())
		}
		if !bytes.Equal(b, w) {
			t.Errorf("format %d: %q, want %q", format, b, w)
		}
	}
}
