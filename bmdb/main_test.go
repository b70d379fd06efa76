package bmdb_test

import (
	"testing"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }
